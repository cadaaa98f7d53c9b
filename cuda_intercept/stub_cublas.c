/* libcublas.so.13 stand-in: the hand-written bodies; stubs.py generates a refusing stub for every other export.
 *
 * Here: what does not return a status (a caller would read garbage, or crash on a NULL string), and
 * the version queries, which must answer so a program can say what it runs against.  The build
 * defines RGPU_LIB, RGPU_NOT_SUPPORTED, RGPU_VERSION_{MAJOR,MINOR,PATCH}, RGPU_CUDART_VERSION.
 */
#include <stddef.h>

#include "stub.h"
#include "stub_cublas_status.h"

typedef struct { float x, y; } rgpu_complex;          /* cuComplex */
typedef struct { double x, y; } rgpu_double_complex;  /* cuDoubleComplex */

RGPU_API const char *cublasGetStatusName(int status) { return rgpu_cublas_status_name(status); }
RGPU_API const char *cublasGetStatusString(int status) { return rgpu_cublas_status_string(status); }
RGPU_API size_t cublasGetCudartVersion(void) { return RGPU_CUDART_VERSION; }

/* cublasGetProperty answers in lib_cublas.c: the server's version once known. */

/* The legacy API (cublas.h) returns results, not statuses; its errors go to cublasGetError, a stub. */
RGPU_STUB_AS(float, cublasSasum, 0.0f)
RGPU_STUB_AS(float, cublasScasum, 0.0f)
RGPU_STUB_AS(float, cublasScnrm2, 0.0f)
RGPU_STUB_AS(float, cublasSdot, 0.0f)
RGPU_STUB_AS(float, cublasSnrm2, 0.0f)
RGPU_STUB_AS(double, cublasDasum, 0.0)
RGPU_STUB_AS(double, cublasDdot, 0.0)
RGPU_STUB_AS(double, cublasDnrm2, 0.0)
RGPU_STUB_AS(double, cublasDzasum, 0.0)
RGPU_STUB_AS(double, cublasDznrm2, 0.0)
RGPU_STUB_AS(int, cublasIcamax, 0)
RGPU_STUB_AS(int, cublasIcamin, 0)
RGPU_STUB_AS(int, cublasIdamax, 0)
RGPU_STUB_AS(int, cublasIdamin, 0)
RGPU_STUB_AS(int, cublasIsamax, 0)
RGPU_STUB_AS(int, cublasIsamin, 0)
RGPU_STUB_AS(int, cublasIzamax, 0)
RGPU_STUB_AS(int, cublasIzamin, 0)
RGPU_STUB_AS(rgpu_complex, cublasCdotc, ((rgpu_complex){0.0f, 0.0f}))
RGPU_STUB_AS(rgpu_complex, cublasCdotu, ((rgpu_complex){0.0f, 0.0f}))
RGPU_STUB_AS(rgpu_double_complex, cublasZdotc, ((rgpu_double_complex){0.0, 0.0}))
RGPU_STUB_AS(rgpu_double_complex, cublasZdotu, ((rgpu_double_complex){0.0, 0.0}))
