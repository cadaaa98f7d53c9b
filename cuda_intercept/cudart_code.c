/* rgpu's libcudart.so.13: what a program asks about its code.  Function attributes (cached per kernel),
 * occupancy, symbols, and the runtime's library API (cudaLibrary*, the CUDA 12 loading API).
 *
 * A kernel or a variable is found through the registration tables
 * (cudart_launch.c), its fatbin loaded at the first question; attributes are
 * asked of the server once per kernel and then answered here.
 */
#include "cudart_internal.h"

/* ---- function attributes (cached per kernel) and occupancy -------------------------------- */
RT_API cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes *attr, const void *func) {
    CUkernel k;
    if (!attr) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_kernel(func, &k);
    if (e) return e;
    struct cudaFuncAttributes **slot = rt_attrs_slot(func);
    if (!*slot) {
        struct cudaFuncAttributes *a = calloc(1, sizeof *a);
        int v, dev = rt_device();
        CUresult r = CUDA_SUCCESS;
        if (!a) return rt_ret(cudaErrorMemoryAllocation);
#define Q(field, name) if (r == CUDA_SUCCESS && (r = cuKernelGetAttribute(&v, CU_FUNC_ATTRIBUTE_##name, k, dev)) == CUDA_SUCCESS) a->field = v
        Q(sharedSizeBytes, SHARED_SIZE_BYTES); Q(constSizeBytes, CONST_SIZE_BYTES); Q(localSizeBytes, LOCAL_SIZE_BYTES);
        Q(maxThreadsPerBlock, MAX_THREADS_PER_BLOCK); Q(numRegs, NUM_REGS); Q(ptxVersion, PTX_VERSION);
        Q(binaryVersion, BINARY_VERSION); Q(cacheModeCA, CACHE_MODE_CA);
        Q(maxDynamicSharedSizeBytes, MAX_DYNAMIC_SHARED_SIZE_BYTES);
        Q(preferredShmemCarveout, PREFERRED_SHARED_MEMORY_CARVEOUT);
#undef Q
        if (r != CUDA_SUCCESS) { free(a); return rt_cu(r); }
        *slot = a;                        /* a racing thread's copy is equal; one of them leaks, once */
    }
    *attr = **slot;
    return cudaSuccess;
}

RT_API cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value) {
    CUkernel k;
    cudaError_t e = rt_kernel(func, &k);
    if (e) return e;
    struct cudaFuncAttributes *cached = *rt_attrs_slot(func);
    /* the runtime's attribute numbers are the driver's CUfunction_attribute ones */
    if ((e = rt_cu(cuKernelSetAttribute((CUfunction_attribute)attr, value, k, rt_device())))) return e;
    if (cached) {
        if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) cached->maxDynamicSharedSizeBytes = value;
        if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) cached->preferredShmemCarveout = value;
    }
    return cudaSuccess;
}

RT_API cudaError_t cudaFuncSetCacheConfig(const void *func, enum cudaFuncCache config) {
    CUkernel k;
    cudaError_t e = rt_kernel(func, &k);
    return e ? e : rt_cu(cuKernelSetCacheConfig(k, (CUfunc_cache)config, rt_device()));
}

RT_API cudaError_t cudaFuncGetParamInfo(const void *func, size_t index, size_t *offset, size_t *size) {
    CUkernel k;
    cudaError_t e = rt_kernel(func, &k);
    return e ? e : rt_cu(cuKernelGetParamInfo(k, index, offset, size));
}

RT_API cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, const void *func, int block,
                                                                          size_t shmem, unsigned int flags) {
    CUkernel k;
    CUfunction fn;
    cudaError_t e = rt_kernel(func, &k);
    if (e) return e;
    if ((e = rt_cu(cuKernelGetFunction(&fn, k)))) return e;
    return rt_cu(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n, fn, block, shmem, flags));
}

RT_API cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *n, const void *func, int block, size_t shmem) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n, func, block, shmem, 0);
}

/* ---- symbols ----------------------------------------------------------------------------- */
static cudaError_t symbol_err(const void *symbol, CUdeviceptr *dptr, size_t *size) {
    cudaError_t e = rt_ctx();
    if (e) return e;
    CUresult r = rt_symbol(symbol, dptr, size);
    return r == CUDA_ERROR_NOT_FOUND ? rt_ret(cudaErrorInvalidSymbol) : rt_cu(r);
}

RT_API cudaError_t cudaGetSymbolAddress(void **devPtr, const void *symbol) {
    CUdeviceptr d;
    if (!devPtr) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = symbol_err(symbol, &d, NULL);
    if (!e) *devPtr = (void *)(uintptr_t)d;
    return e;
}

RT_API cudaError_t cudaGetSymbolSize(size_t *size, const void *symbol) {
    if (!size) return rt_ret(cudaErrorInvalidValue);
    return symbol_err(symbol, NULL, size);
}

cudaError_t rt_symbol_range(const void *symbol, size_t offset, size_t count, CUdeviceptr *at) {
    CUdeviceptr d;
    size_t size;
    cudaError_t e = symbol_err(symbol, &d, &size);
    if (e) return e;
    if (offset > size || count > size - offset) return rt_ret(cudaErrorInvalidValue);
    *at = d + offset;
    return cudaSuccess;
}

/* ---- the library API: each call its driver twin (the runtime's option numbers are the driver's) ----- */
RT_API cudaError_t cudaLibraryLoadData(cudaLibrary_t *lib, const void *code, enum cudaJitOption *jitOptions,
                                       void **jitValues, unsigned int njit, enum cudaLibraryOption *libOptions,
                                       void **libValues, unsigned int nlib) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuLibraryLoadData((CUlibrary *)lib, code, (CUjit_option *)jitOptions, jitValues, njit,
                                           (CUlibraryOption *)libOptions, libValues, nlib));
}

RT_API cudaError_t cudaLibraryLoadFromFile(cudaLibrary_t *lib, const char *fileName, enum cudaJitOption *jitOptions,
                                           void **jitValues, unsigned int njit, enum cudaLibraryOption *libOptions,
                                           void **libValues, unsigned int nlib) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuLibraryLoadFromFile((CUlibrary *)lib, fileName, (CUjit_option *)jitOptions, jitValues,
                                               njit, (CUlibraryOption *)libOptions, libValues, nlib));
}

RT_API cudaError_t cudaLibraryUnload(cudaLibrary_t lib) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuLibraryUnload((CUlibrary)lib));
}

RT_API cudaError_t cudaLibraryGetKernel(cudaKernel_t *k, cudaLibrary_t lib, const char *name) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuLibraryGetKernel((CUkernel *)k, (CUlibrary)lib, name));
}

RT_API cudaError_t cudaLibraryGetGlobal(void **dptr, size_t *bytes, cudaLibrary_t lib, const char *name) {
    CUdeviceptr d = 0;
    cudaError_t e = rt_ctx();
    if (e || (e = rt_cu(cuLibraryGetGlobal(&d, bytes, (CUlibrary)lib, name)))) return e;
    if (dptr) *dptr = (void *)(uintptr_t)d;
    return cudaSuccess;
}

RT_API cudaError_t cudaKernelSetAttributeForDevice(cudaKernel_t k, enum cudaFuncAttribute attr, int value, int device) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuKernelSetAttribute((CUfunction_attribute)attr, value, (CUkernel)k, device));
}
