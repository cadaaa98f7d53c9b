/* cublasStatus_t's names and texts (cublas_api.h), shared by libcublas.so.13 and libcublasLt.so.13:
 * the texts are the stock libraries' own (cublasGetStatusString). */
#ifndef RGPU_STUB_CUBLAS_STATUS_H
#define RGPU_STUB_CUBLAS_STATUS_H

static const struct { int code; const char *name, *text; } rgpu_cublas_statuses[] = {
    {0, "CUBLAS_STATUS_SUCCESS", "success"},
    {1, "CUBLAS_STATUS_NOT_INITIALIZED", "the library was not initialized"},
    {3, "CUBLAS_STATUS_ALLOC_FAILED", "the resource allocation failed"},
    {7, "CUBLAS_STATUS_INVALID_VALUE", "an unsupported value or parameter was passed to the function"},
    {8, "CUBLAS_STATUS_ARCH_MISMATCH", "the function requires an architectural feature absent from the device"},
    {11, "CUBLAS_STATUS_MAPPING_ERROR", "an access to GPU memory space failed"},
    {13, "CUBLAS_STATUS_EXECUTION_FAILED", "the function failed to launch on the GPU"},
    {14, "CUBLAS_STATUS_INTERNAL_ERROR", "an internal operation failed"},
    {15, "CUBLAS_STATUS_NOT_SUPPORTED", "the requested functionality is not supported"},
    {16, "CUBLAS_STATUS_LICENSE_ERROR", "the license check failed"},
};

static const char *rgpu_cublas_status_name(int status) {
    for (size_t i = 0; i < sizeof rgpu_cublas_statuses / sizeof *rgpu_cublas_statuses; i++)
        if (rgpu_cublas_statuses[i].code == status) return rgpu_cublas_statuses[i].name;
    return "unrecognized status";
}

static const char *rgpu_cublas_status_string(int status) {
    for (size_t i = 0; i < sizeof rgpu_cublas_statuses / sizeof *rgpu_cublas_statuses; i++)
        if (rgpu_cublas_statuses[i].code == status) return rgpu_cublas_statuses[i].text;
    return "unrecognized status";
}
#endif
