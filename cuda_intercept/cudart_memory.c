/* rgpu's libcudart.so.13: memory.  Allocations, copies of every kind, memsets, page-locked host memory, pools.
 *
 * Each call is its driver twin on rgpu's libcuda.so.1, which queues the ones
 * that only show at a later synchronisation (copies to the device, device to
 * device, memsets, frees) and waits for copies to the host.  cudaMemcpyDefault
 * asks the driver's record of this process's device allocations (answered in
 * C) which side each pointer is on.
 */
#include "cudart_internal.h"

#define D(p) ((CUdeviceptr)(uintptr_t)(p))

static void refuse(const char *what, const char *why) {
    fprintf(stderr, "rgpu: %s is not supported over rgpu: %s\n", what, why);
}

/* ---- allocations ------------------------------------------------------------------------- */
RT_API cudaError_t cudaMalloc(void **p, size_t size) {
    CUdeviceptr d = 0;
    if (!p) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_ctx();
    if (e) return e;
    *p = NULL;
    if (!size) return cudaSuccess;
    if ((e = rt_cu(cuMemAlloc(&d, size)))) return e;
    *p = (void *)(uintptr_t)d;
    return cudaSuccess;
}

RT_API cudaError_t cudaFree(void *p) {
    cudaError_t e = rt_ctx();             /* cudaFree(0) is the idiom that makes the context */
    if (e || !p) return e;
    return rt_cu(cuMemFree(D(p)));
}

RT_API cudaError_t cudaMallocHost(void **p, size_t size) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemAllocHost(p, size));
}

RT_API cudaError_t cudaHostAlloc(void **p, size_t size, unsigned int flags) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemHostAlloc(p, size, flags));
}

RT_API cudaError_t cudaFreeHost(void *p) {
    cudaError_t e = rt_ctx();
    return e || !p ? e : rt_cu(cuMemFreeHost(p));
}

RT_API cudaError_t cudaHostRegister(void *p, size_t size, unsigned int flags) {
    if (flags & cudaHostRegisterMapped) {
        refuse("cudaHostRegister(cudaHostRegisterMapped)", "mapped host memory cannot be reached by a GPU across a network");
        return rt_ret(cudaErrorNotSupported);
    }
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemHostRegister(p, size, flags));
}

RT_API cudaError_t cudaHostUnregister(void *p) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemHostUnregister(p));
}

RT_API cudaError_t cudaHostGetFlags(unsigned int *flags, void *p) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemHostGetFlags(flags, p));
}

RT_API cudaError_t cudaMallocManaged(void **p, size_t size, unsigned int flags) {
    (void)p; (void)size; (void)flags;
    refuse("cudaMallocManaged", "managed memory cannot be shared with a GPU across a network");
    return rt_ret(cudaErrorNotSupported);
}

RT_API cudaError_t cudaMemGetInfo(size_t *free_, size_t *total) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemGetInfo(free_, total));
}

/* ---- which side a pointer is on ---------------------------------------------------------- */
static int on_device(const void *p) {
    unsigned int type = 0;
    return p && cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, D(p)) == CUDA_SUCCESS
           && type == CU_MEMORYTYPE_DEVICE;
}

static enum cudaMemcpyKind resolve(enum cudaMemcpyKind kind, const void *dst, const void *src) {
    if (kind != cudaMemcpyDefault) return kind;
    int d = on_device(dst), s = on_device(src);
    return d ? (s ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
             : (s ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
}

RT_API cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
    unsigned int type = 0;
    int dev = 0;
    if (!a) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_ctx();
    if (e) return e;
    memset(a, 0, sizeof *a);
    a->type = cudaMemoryTypeUnregistered;
    if (!p || cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, D(p)) != CUDA_SUCCESS)
        return cudaSuccess;               /* plain host memory: unregistered, not an error (CUDA 11+) */
    cuPointerGetAttribute(&dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, D(p));
    a->device = dev;
    if (type == CU_MEMORYTYPE_DEVICE) {
        a->type = cudaMemoryTypeDevice;
        a->devicePointer = (void *)p;
    } else if (type == CU_MEMORYTYPE_HOST) {
        a->type = cudaMemoryTypeHost;     /* page-locked; never mapped into the remote GPU */
        a->hostPointer = (void *)p;
    }
    return cudaSuccess;
}

/* ---- copies ------------------------------------------------------------------------------ */
static cudaError_t copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s, int async, int pt) {
    CUstream st = rt_stream(s, pt);
    cudaError_t e = rt_ctx();
    if (e) return e;
    if (!n) return cudaSuccess;
    switch (resolve(kind, dst, src)) {
    case cudaMemcpyHostToDevice:
        return async ? rt_cu(cuMemcpyHtoDAsync(D(dst), src, n, st)) : rt_cu_sync(cuMemcpyHtoD(D(dst), src, n));
    case cudaMemcpyDeviceToHost:
        return rt_cu_sync(async ? cuMemcpyDtoHAsync(dst, D(src), n, st) : cuMemcpyDtoH(dst, D(src), n));
    case cudaMemcpyDeviceToDevice:
        return rt_cu(async ? cuMemcpyDtoDAsync(D(dst), D(src), n, st) : cuMemcpyDtoD(D(dst), D(src), n));
    case cudaMemcpyHostToHost:
        /* stream-ordered: what the stream holds before it runs first */
        if ((e = rt_cu_sync(async ? cuStreamSynchronize(st) : cuCtxSynchronize()))) return e;
        memmove(dst, src, n);
        return cudaSuccess;
    default:
        return rt_ret(cudaErrorInvalidMemcpyDirection);
    }
}

RT_API cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
    return copy(dst, src, n, kind, NULL, 0, 0);
}

RT_API cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
    return copy(dst, src, n, kind, NULL, 0, 1);
}

RT_API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s) {
    return copy(dst, src, n, kind, s, 1, 0);
}

RT_API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s) {
    return copy(dst, src, n, kind, s, 1, 1);
}

RT_API cudaError_t cudaMemcpyPeer(void *dst, int dstDevice, const void *src, int srcDevice, size_t n) {
    (void)dstDevice; (void)srcDevice;     /* one session's devices share one address space on the server */
    return copy(dst, src, n, cudaMemcpyDeviceToDevice, NULL, 0, 0);
}

RT_API cudaError_t cudaMemcpyPeerAsync(void *dst, int dstDevice, const void *src, int srcDevice, size_t n, cudaStream_t s) {
    (void)dstDevice; (void)srcDevice;
    return copy(dst, src, n, cudaMemcpyDeviceToDevice, s, 1, 0);
}

/* 2D copies as one copy when both sides are dense, else row by row on the stream. */
static cudaError_t copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t w, size_t h,
                          enum cudaMemcpyKind kind, cudaStream_t s, int async, int pt) {
    cudaError_t e;
    if (w > dpitch || w > spitch) return rt_ret(cudaErrorInvalidPitchValue);
    if (dpitch == w && spitch == w) return copy(dst, src, w * h, kind, s, async, pt);
    kind = resolve(kind, dst, src);
    for (size_t r = 0; r < h; r++)
        if ((e = copy((char *)dst + r * dpitch, (const char *)src + r * spitch, w, kind, s, 1, pt))) return e;
    if (!async && kind == cudaMemcpyDeviceToHost) return rt_cu_sync(cuStreamSynchronize(rt_stream(s, pt)));
    return cudaSuccess;
}

RT_API cudaError_t cudaMemcpy2D(void *dst, size_t dpitch, const void *src, size_t spitch, size_t w, size_t h,
                                enum cudaMemcpyKind kind) {
    return copy2d(dst, dpitch, src, spitch, w, h, kind, NULL, 0, 0);
}

RT_API cudaError_t cudaMemcpy2D_ptds(void *dst, size_t dpitch, const void *src, size_t spitch, size_t w, size_t h,
                                     enum cudaMemcpyKind kind) {
    return copy2d(dst, dpitch, src, spitch, w, h, kind, NULL, 0, 1);
}

RT_API cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t w, size_t h,
                                     enum cudaMemcpyKind kind, cudaStream_t s) {
    return copy2d(dst, dpitch, src, spitch, w, h, kind, s, 1, 0);
}

RT_API cudaError_t cudaMemcpy2DAsync_ptsz(void *dst, size_t dpitch, const void *src, size_t spitch, size_t w,
                                          size_t h, enum cudaMemcpyKind kind, cudaStream_t s) {
    return copy2d(dst, dpitch, src, spitch, w, h, kind, s, 1, 1);
}

/* ---- symbols: the variable's address from the owning fatbin's library --------------------- */
static cudaError_t to_symbol(const void *symbol, const void *src, size_t n, size_t off, enum cudaMemcpyKind kind,
                             cudaStream_t s, int async, int pt) {
    CUdeviceptr at;
    cudaError_t e = rt_symbol_range(symbol, off, n, &at);
    if (e) return e;
    if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault)
        return rt_ret(cudaErrorInvalidMemcpyDirection);
    return copy((void *)(uintptr_t)at, src, n, kind, s, async, pt);
}

static cudaError_t from_symbol(void *dst, const void *symbol, size_t n, size_t off, enum cudaMemcpyKind kind,
                               cudaStream_t s, int async, int pt) {
    CUdeviceptr at;
    cudaError_t e = rt_symbol_range(symbol, off, n, &at);
    if (e) return e;
    if (kind != cudaMemcpyDeviceToHost && kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault)
        return rt_ret(cudaErrorInvalidMemcpyDirection);
    return copy(dst, (const void *)(uintptr_t)at, n, kind, s, async, pt);
}

RT_API cudaError_t cudaMemcpyToSymbol(const void *sym, const void *src, size_t n, size_t off, enum cudaMemcpyKind k) {
    return to_symbol(sym, src, n, off, k, NULL, 0, 0);
}

RT_API cudaError_t cudaMemcpyToSymbol_ptds(const void *sym, const void *src, size_t n, size_t off, enum cudaMemcpyKind k) {
    return to_symbol(sym, src, n, off, k, NULL, 0, 1);
}

RT_API cudaError_t cudaMemcpyToSymbolAsync(const void *sym, const void *src, size_t n, size_t off,
                                           enum cudaMemcpyKind k, cudaStream_t s) {
    return to_symbol(sym, src, n, off, k, s, 1, 0);
}

RT_API cudaError_t cudaMemcpyToSymbolAsync_ptsz(const void *sym, const void *src, size_t n, size_t off,
                                                enum cudaMemcpyKind k, cudaStream_t s) {
    return to_symbol(sym, src, n, off, k, s, 1, 1);
}

RT_API cudaError_t cudaMemcpyFromSymbol(void *dst, const void *sym, size_t n, size_t off, enum cudaMemcpyKind k) {
    return from_symbol(dst, sym, n, off, k, NULL, 0, 0);
}

RT_API cudaError_t cudaMemcpyFromSymbol_ptds(void *dst, const void *sym, size_t n, size_t off, enum cudaMemcpyKind k) {
    return from_symbol(dst, sym, n, off, k, NULL, 0, 1);
}

RT_API cudaError_t cudaMemcpyFromSymbolAsync(void *dst, const void *sym, size_t n, size_t off,
                                             enum cudaMemcpyKind k, cudaStream_t s) {
    return from_symbol(dst, sym, n, off, k, s, 1, 0);
}

RT_API cudaError_t cudaMemcpyFromSymbolAsync_ptsz(void *dst, const void *sym, size_t n, size_t off,
                                                  enum cudaMemcpyKind k, cudaStream_t s) {
    return from_symbol(dst, sym, n, off, k, s, 1, 1);
}

/* ---- memsets (queued) -------------------------------------------------------------------- */
static cudaError_t set(void *p, int value, size_t n, cudaStream_t s, int pt) {
    cudaError_t e = rt_ctx();
    return e || !n ? e : rt_cu(cuMemsetD8Async(D(p), (unsigned char)value, n, rt_stream(s, pt)));
}

RT_API cudaError_t cudaMemset(void *p, int value, size_t n) { return set(p, value, n, NULL, 0); }
RT_API cudaError_t cudaMemset_ptds(void *p, int value, size_t n) { return set(p, value, n, NULL, 1); }
RT_API cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t s) { return set(p, value, n, s, 0); }
RT_API cudaError_t cudaMemsetAsync_ptsz(void *p, int value, size_t n, cudaStream_t s) { return set(p, value, n, s, 1); }

static cudaError_t set2d(void *p, size_t pitch, int value, size_t w, size_t h, cudaStream_t s, int pt) {
    cudaError_t e;
    if (pitch == w) return set(p, value, w * h, s, pt);
    for (size_t r = 0; r < h; r++)
        if ((e = set((char *)p + r * pitch, value, w, s, pt))) return e;
    return cudaSuccess;
}

RT_API cudaError_t cudaMemset2D(void *p, size_t pitch, int v, size_t w, size_t h) { return set2d(p, pitch, v, w, h, NULL, 0); }
RT_API cudaError_t cudaMemset2D_ptds(void *p, size_t pitch, int v, size_t w, size_t h) { return set2d(p, pitch, v, w, h, NULL, 1); }
RT_API cudaError_t cudaMemset2DAsync(void *p, size_t pitch, int v, size_t w, size_t h, cudaStream_t s) {
    return set2d(p, pitch, v, w, h, s, 0);
}
RT_API cudaError_t cudaMemset2DAsync_ptsz(void *p, size_t pitch, int v, size_t w, size_t h, cudaStream_t s) {
    return set2d(p, pitch, v, w, h, s, 1);
}

/* ---- stream-ordered allocation and pools ------------------------------------------------- */
static cudaError_t malloc_async(void **p, size_t size, cudaStream_t s, int pt) {
    CUdeviceptr d = 0;
    if (!p) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_ctx();
    if (e) return e;
    if ((e = rt_cu(cuMemAllocAsync(&d, size, rt_stream(s, pt))))) return e;
    *p = (void *)(uintptr_t)d;
    return cudaSuccess;
}

RT_API cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s) { return malloc_async(p, size, s, 0); }
RT_API cudaError_t cudaMallocAsync_ptsz(void **p, size_t size, cudaStream_t s) { return malloc_async(p, size, s, 1); }

static cudaError_t free_async(void *p, cudaStream_t s, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemFreeAsync(D(p), rt_stream(s, pt)));
}

RT_API cudaError_t cudaFreeAsync(void *p, cudaStream_t s) { return free_async(p, s, 0); }
RT_API cudaError_t cudaFreeAsync_ptsz(void *p, cudaStream_t s) { return free_async(p, s, 1); }

static cudaError_t from_pool(void **p, size_t size, cudaMemPool_t pool, cudaStream_t s, int pt) {
    CUdeviceptr d = 0;
    if (!p) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_ctx();
    if (e) return e;
    if ((e = rt_cu(cuMemAllocFromPoolAsync(&d, size, (CUmemoryPool)pool, rt_stream(s, pt))))) return e;
    *p = (void *)(uintptr_t)d;
    return cudaSuccess;
}

RT_API cudaError_t cudaMallocFromPoolAsync(void **p, size_t size, cudaMemPool_t pool, cudaStream_t s) {
    return from_pool(p, size, pool, s, 0);
}

RT_API cudaError_t cudaMallocFromPoolAsync_ptsz(void **p, size_t size, cudaMemPool_t pool, cudaStream_t s) {
    return from_pool(p, size, pool, s, 1);
}

RT_API cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuDeviceGetDefaultMemPool((CUmemoryPool *)pool, device));
}

RT_API cudaError_t cudaDeviceGetMemPool(cudaMemPool_t *pool, int device) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuDeviceGetMemPool((CUmemoryPool *)pool, device));
}

/* the runtime's pool attribute numbers are the driver's */
RT_API cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemPoolSetAttribute((CUmemoryPool)pool, (CUmemPool_attribute)attr, value));
}

/* Access to a pool: the driver's answer (libcuda.so.1 knows which device each pool is on). */
RT_API cudaError_t cudaMemPoolSetAccess(cudaMemPool_t pool, const struct cudaMemAccessDesc *descs, size_t count) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemPoolSetAccess((CUmemoryPool)pool, (const CUmemAccessDesc *)descs, count));
}

RT_API cudaError_t cudaMemPoolGetAccess(enum cudaMemAccessFlags *flags, cudaMemPool_t pool,
                                        struct cudaMemLocation *location) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemPoolGetAccess((CUmemAccess_flags *)flags, (CUmemoryPool)pool, (CUmemLocation *)location));
}

RT_API cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemPoolGetAttribute((CUmemoryPool)pool, (CUmemPool_attribute)attr, value));
}

RT_API cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t minBytesToKeep) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuMemPoolTrimTo((CUmemoryPool)pool, minBytesToKeep));
}

/* ---- refused: memory the remote GPU would have to reach in this process -------------------------- */
#define MAPPED "mapped host memory cannot be reached by a GPU across a network"
#define MANAGED "managed memory cannot be shared with a GPU across a network"

RT_API cudaError_t cudaHostGetDevicePointer(void **pDevice, void *pHost, unsigned int flags) {
    (void)pDevice; (void)pHost; (void)flags;
    refuse("cudaHostGetDevicePointer", MAPPED);
    return rt_ret(cudaErrorNotSupported);
}

static cudaError_t managed(const char *what) {
    refuse(what, MANAGED);
    return rt_ret(cudaErrorNotSupported);
}

RT_API cudaError_t cudaStreamAttachMemAsync(cudaStream_t s, void *p, size_t n, unsigned int flags) {
    (void)s; (void)p; (void)n; (void)flags;
    return managed("cudaStreamAttachMemAsync");
}

RT_API cudaError_t cudaStreamAttachMemAsync_ptsz(cudaStream_t s, void *p, size_t n, unsigned int flags) {
    (void)s; (void)p; (void)n; (void)flags;
    return managed("cudaStreamAttachMemAsync");
}

RT_API cudaError_t cudaMemPrefetchAsync(const void *p, size_t n, struct cudaMemLocation loc, unsigned int flags,
                                        cudaStream_t s) {
    (void)p; (void)n; (void)loc; (void)flags; (void)s;
    return managed("cudaMemPrefetchAsync");
}

RT_API cudaError_t cudaMemPrefetchAsync_ptsz(const void *p, size_t n, struct cudaMemLocation loc, unsigned int flags,
                                             cudaStream_t s) {
    (void)p; (void)n; (void)loc; (void)flags; (void)s;
    return managed("cudaMemPrefetchAsync");
}

RT_API cudaError_t cudaMemAdvise(const void *p, size_t n, enum cudaMemoryAdvise advice, struct cudaMemLocation loc) {
    (void)p; (void)n; (void)advice; (void)loc;
    return managed("cudaMemAdvise");
}
