/* libcudnn.so.9 stand-in: the hand-written bodies; stubs.py generates a refusing stub for every other export.
 *
 * Here: what does not return a status, and the version queries torch makes at import and in
 * torch.backends.cudnn (a garbage version there fails torch's compatibility check).  The build
 * defines RGPU_LIB, RGPU_NOT_SUPPORTED, RGPU_VERSION_{MAJOR,MINOR,PATCH}, RGPU_CUDART_VERSION.
 * This library never loads cuDNN's sub-libraries (libcudnn_graph.so.9, the engines).
 */
#include <stddef.h>
#include <string.h>

#include "stub.h"

/* cudnnStatus_t (cudnn_graph.h); the names are the stock library's texts */
static const struct { int code; const char *name; } statuses[] = {
    {0, "CUDNN_STATUS_SUCCESS"},
    {1001, "CUDNN_STATUS_NOT_INITIALIZED"},
    {1002, "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH"},
    {1003, "CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH"},
    {1004, "CUDNN_STATUS_DEPRECATED"},
    {1005, "CUDNN_STATUS_LICENSE_ERROR"},
    {1006, "CUDNN_STATUS_RUNTIME_IN_PROGRESS"},
    {1007, "CUDNN_STATUS_RUNTIME_FP_OVERFLOW"},
    {1008, "CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED"},
    {2000, "CUDNN_STATUS_BAD_PARAM"},
    {2001, "CUDNN_STATUS_INVALID_VALUE"},
    {2002, "CUDNN_STATUS_BAD_PARAM_NULL_POINTER"},
    {2003, "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER"},
    {2004, "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED"},
    {2005, "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND"},
    {2006, "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT"},
    {2007, "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH"},
    {2008, "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH"},
    {2009, "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES"},
    {2010, "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE"},
    {2011, "CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH"},
    {2012, "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE"},
    {3000, "CUDNN_STATUS_NOT_SUPPORTED"},
    {3001, "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN"},
    {3002, "CUDNN_STATUS_NOT_SUPPORTED_SHAPE"},
    {3003, "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE"},
    {3004, "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT"},
    {3005, "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER"},
    {3006, "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART"},
    {3007, "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH"},
    {3008, "CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING"},
    {3009, "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE"},
    {3010, "CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT"},
    {3011, "CUDNN_STATUS_NOT_SUPPORTED_PADDING"},
    {3012, "CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM"},
    {3013, "CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API"},
    {3014, "CUDNN_STATUS_NOT_SUPPORTED_INVALID_DYNAMIC_SHAPE"},
    {4000, "CUDNN_STATUS_INTERNAL_ERROR"},
    {4001, "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED"},
    {4002, "CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE"},
    {4003, "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"},
    {4004, "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"},
    {4005, "CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM"},
    {4006, "CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED"},
    {5000, "CUDNN_STATUS_EXECUTION_FAILED"},
    {5001, "CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER"},
    {5002, "CUDNN_STATUS_EXECUTION_FAILED_CUBLAS"},
    {5003, "CUDNN_STATUS_EXECUTION_FAILED_CUDART"},
    {5004, "CUDNN_STATUS_EXECUTION_FAILED_CURAND"},
};

/* CUDNN_VERSION's encoding: major * 10000 + minor * 100 + patch */
RGPU_API size_t cudnnGetVersion(void) {
    return RGPU_VERSION_MAJOR * 10000 + RGPU_VERSION_MINOR * 100 + RGPU_VERSION_PATCH;
}

/* the newest SM cuDNN 9.19 knows natively (sm_121); the real value is the server's concern */
RGPU_API size_t cudnnGetMaxDeviceVersion(void) { return 1210; }
RGPU_API size_t cudnnGetCudartVersion(void) { return RGPU_CUDART_VERSION; }

RGPU_API const char *cudnnGetErrorString(int status) {
    for (size_t i = 0; i < sizeof statuses / sizeof *statuses; i++)
        if (statuses[i].code == status) return statuses[i].name;
    return "CUDNN_UNKNOWN_STATUS";
}

/* The last refusal on this thread, then cleared, as cuDNN clears its own message once read. */
RGPU_API void cudnnGetLastErrorString(char *message, size_t max_size) {
    if (!message || !max_size) return;
    strncpy(message, rgpu_stub_last(), max_size - 1);
    message[max_size - 1] = 0;
    rgpu_stub_clear();
}

/* libraryPropertyType: MAJOR_VERSION 0, MINOR_VERSION 1, PATCH_LEVEL 2 */
RGPU_API int cudnnGetProperty(int type, int *value) {
    static const int v[] = {RGPU_VERSION_MAJOR, RGPU_VERSION_MINOR, RGPU_VERSION_PATCH};
    if (!value || type < 0 || type > 2) return 2000;   /* CUDNN_STATUS_BAD_PARAM */
    *value = v[type];
    return 0;
}
