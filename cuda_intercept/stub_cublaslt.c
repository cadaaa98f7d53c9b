/* libcublasLt.so.13 stand-in: the hand-written bodies; stubs.py generates a refusing stub for every other export.
 *
 * Here: what does not return a status, and the version queries.  The build defines RGPU_LIB,
 * RGPU_NOT_SUPPORTED, RGPU_VERSION_{MAJOR,MINOR,PATCH}, RGPU_CUDART_VERSION.
 */
#include <stddef.h>

#include "stub.h"
#include "stub_cublas_status.h"

RGPU_API const char *cublasLtGetStatusName(int status) { return rgpu_cublas_status_name(status); }
RGPU_API const char *cublasLtGetStatusString(int status) { return rgpu_cublas_status_string(status); }
RGPU_API size_t cublasLtGetCudartVersion(void) { return RGPU_CUDART_VERSION; }

/* CUBLAS_VERSION's encoding: major * 10000 + minor * 100 + patch */
RGPU_API size_t cublasLtGetVersion(void) {
    return RGPU_VERSION_MAJOR * 10000 + RGPU_VERSION_MINOR * 100 + RGPU_VERSION_PATCH;
}

RGPU_API int cublasLtGetProperty(int type, int *value) {
    static const int v[] = {RGPU_VERSION_MAJOR, RGPU_VERSION_MINOR, RGPU_VERSION_PATCH};
    if (!value || type < 0 || type > 2) return 7;   /* CUBLAS_STATUS_INVALID_VALUE */
    *value = v[type];
    return 0;
}
