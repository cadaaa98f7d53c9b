/* rgpu's libcudart.so.13, its state: devices, contexts, errors, properties, versions, driver entry points.
 *
 * Per thread: the current device and the last error.  Per process: the
 * primary contexts (retained on first use, as the stock runtime does), the
 * device-property structs (built once per device from attributes libcuda.so.1
 * answers in C), and the sticky error of a kernel fault.  cudaGetDevice and
 * cudaGetLastError, which torch calls thousands of times a step, read
 * thread-local variables and the driver's C-answered current context.
 */
#include "cudart_internal.h"

static __thread int rt_dev;                 /* cudaSetDevice's choice; 0 by default */
static __thread cudaError_t rt_last;
static __thread CUcontext rt_bound;         /* the primary context this thread was given, for rt_dev */
static volatile int rt_inited;
static int rt_ndev;
static cudaError_t rt_init_error;
static cudaError_t rt_sticky_error;
static CUcontext rt_prim[RT_MAX_DEV];
static struct cudaDeviceProp *rt_props[RT_MAX_DEV];
static pthread_mutex_t rt_lock = PTHREAD_MUTEX_INITIALIZER;

cudaError_t rt_ret(cudaError_t e) {
    if (e != cudaSuccess) rt_last = e;
    return e;
}

cudaError_t rt_cu(CUresult r) {
    if (r == CUDA_SUCCESS) return cudaSuccess;
    return rt_ret(rt_error_known((int)r) ? (cudaError_t)r : cudaErrorUnknown);
}

/* Faults that leave the context unusable: CUDA reports them from then on, to every call. */
static int rt_is_sticky(cudaError_t e) {
    switch ((int)e) {
    case cudaErrorIllegalAddress: case cudaErrorLaunchFailure: case cudaErrorLaunchTimeout:
    case cudaErrorAssert: case cudaErrorHardwareStackError: case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress: case cudaErrorInvalidAddressSpace: case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable: return 1;
    default: return 0;
    }
}

cudaError_t rt_cu_sync(CUresult r) {
    cudaError_t e = rt_cu(r);
    if (rt_is_sticky(e)) rt_sticky_error = e;
    return e;
}

cudaError_t rt_sticky(void) { return rt_sticky_error; }

static cudaError_t rt_init(void) {
    if (rt_inited) return rt_init_error;
    pthread_mutex_lock(&rt_lock);
    if (!rt_inited) {
        CUresult r = cuInit(0);
        int n = 0;
        if (r == CUDA_SUCCESS) r = cuDeviceGetCount(&n);
        rt_ndev = n > RT_MAX_DEV ? RT_MAX_DEV : n;
        rt_init_error = r == CUDA_SUCCESS ? cudaSuccess
                      : r == CUDA_ERROR_NO_DEVICE ? cudaErrorNoDevice
                      : rt_error_known((int)r) ? (cudaError_t)r : cudaErrorInitializationError;
        rt_inited = 1;
    }
    pthread_mutex_unlock(&rt_lock);
    return rt_init_error;
}

cudaError_t rt_primary(int dev, CUcontext *out) {
    cudaError_t e = rt_init();
    if (e) return e;
    if (dev < 0 || dev >= rt_ndev) return cudaErrorInvalidDevice;
    pthread_mutex_lock(&rt_lock);
    CUresult r = rt_prim[dev] ? CUDA_SUCCESS : cuDevicePrimaryCtxRetain(&rt_prim[dev], dev);
    *out = rt_prim[dev];
    pthread_mutex_unlock(&rt_lock);
    return rt_cu(r);
}

cudaError_t rt_ctx(void) {
    CUcontext cur = NULL, p;
    cudaError_t e = rt_init();
    if (e) return rt_ret(e);
    if (rt_sticky_error) return rt_ret(rt_sticky_error);
    if (cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur) return cudaSuccess;   /* ours, or the program's */
    if ((e = rt_primary(rt_dev, &p))) return rt_ret(e);
    if ((e = rt_cu(cuCtxSetCurrent(p)))) return e;
    rt_bound = p;
    return cudaSuccess;
}

/* A thread's first runtime call: CUDA's runtime makes the primary context of the thread's device current
 * on it when that context exists (torch's autograd thread asks the driver for the current context, then
 * runs cuBLAS, having called nothing else that binds it).  The runtime's own lazy binding is rt_ctx's. */
static __thread int rt_thread_seen;
static void rt_thread_first(void) {
    CUcontext cur = NULL, p;
    if (!rt_inited) return;              /* before cuInit: rt_ctx binds at the first call that needs it */
    rt_thread_seen = 1;
    if (rt_init_error || rt_dev >= rt_ndev) return;
    pthread_mutex_lock(&rt_lock);
    p = rt_prim[rt_dev];
    pthread_mutex_unlock(&rt_lock);
    if (p && cuCtxGetCurrent(&cur) == CUDA_SUCCESS && !cur && cuCtxSetCurrent(p) == CUDA_SUCCESS) rt_bound = p;
}

/* The device of the current context when the program made one current itself, else the thread's. */
int rt_device(void) {
    CUcontext cur = NULL;
    CUdevice d;
    if (!rt_thread_seen) rt_thread_first();
    if (rt_inited && cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur && cur != rt_bound && cuCtxGetDevice(&d) == CUDA_SUCCESS)
        return d;
    return rt_dev;
}

int rt_device_count(void) { return rt_init() ? 0 : rt_ndev; }

/* ---- errors ------------------------------------------------------------------------------ */
RT_API cudaError_t cudaGetLastError(void) {
    if (!rt_thread_seen) rt_thread_first();
    cudaError_t e = rt_last;
    rt_last = rt_sticky_error;            /* a sticky error never clears */
    return e;
}

RT_API cudaError_t cudaPeekAtLastError(void) { return rt_last; }

RT_API const char *cudaGetErrorName(cudaError_t e) {
    const char *n = rt_error_name((int)e);
    return n ? n : "cudaErrorUnknown";
}

RT_API const char *cudaGetErrorString(cudaError_t e) {
    const char *t = rt_error_text((int)e);
    return t ? t : "unrecognized error code";
}

/* ---- devices ----------------------------------------------------------------------------- */
RT_API cudaError_t cudaGetDeviceCount(int *count) {
    if (!count) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_init();
    *count = e ? 0 : rt_ndev;
    return rt_ret(e);
}

RT_API cudaError_t cudaGetDevice(int *device) {
    if (!device) return rt_ret(cudaErrorInvalidValue);
    *device = rt_device();
    return cudaSuccess;
}

RT_API cudaError_t cudaSetDevice(int device) {
    CUcontext p;
    cudaError_t e = rt_primary(device, &p);
    if (e) return rt_ret(e);
    if ((e = rt_cu(cuCtxSetCurrent(p)))) return e;
    rt_dev = device;
    rt_bound = p;
    return cudaSuccess;
}

RT_API cudaError_t cudaInitDevice(int device, unsigned int deviceFlags, unsigned int flags) {
    CUcontext p;
    (void)deviceFlags; (void)flags;
    return rt_ret(rt_primary(device, &p));
}

RT_API cudaError_t cudaSetDeviceFlags(unsigned int flags) {
    cudaError_t e = rt_init();
    if (e) return rt_ret(e);
    return rt_cu(cuDevicePrimaryCtxSetFlags(rt_device(), flags & ~cudaDeviceMapHost));
}

RT_API cudaError_t cudaGetDeviceFlags(unsigned int *flags) {
    unsigned int f = 0;
    int active = 0;
    if (!flags) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_init();
    if (e) return rt_ret(e);
    if ((e = rt_cu(cuDevicePrimaryCtxGetState(rt_device(), &f, &active)))) return e;
    *flags = f;
    return cudaSuccess;
}

RT_API cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    cudaError_t e = rt_init();
    if (e) return rt_ret(e);
    if (!value) return rt_ret(cudaErrorInvalidValue);
    if (device < 0 || device >= rt_ndev) return rt_ret(cudaErrorInvalidDevice);
    /* the runtime's attribute numbers are the driver's */
    return rt_cu(cuDeviceGetAttribute(value, (CUdevice_attribute)attr, device));
}

RT_API cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
    cudaError_t e = rt_init();
    return e ? rt_ret(e) : rt_cu(cuDeviceGetPCIBusId(pciBusId, len, device));
}

RT_API cudaError_t cudaDeviceGetByPCIBusId(int *device, const char *pciBusId) {
    cudaError_t e = rt_init();
    return e ? rt_ret(e) : rt_cu(cuDeviceGetByPCIBusId(device, pciBusId));
}

RT_API cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer) {
    cudaError_t e = rt_init();
    return e ? rt_ret(e) : rt_cu(cuDeviceCanAccessPeer(can, device, peer));
}

/* Peer access: with the thread's own device CUDA answers cudaErrorInvalidDevice, and so do we; across devices
 * it would need the server's cuCtxEnablePeerAccess, which the cuda route does not run: a clear refusal (and
 * disabling what was never enabled is CUDA's own answer).  torch asks for it only where CanAccessPeer said 1. */
static cudaError_t peer_check(int peer) {
    cudaError_t e = rt_ctx();
    if (e) return e;
    return peer < 0 || peer >= rt_device_count() || peer == rt_device() ? rt_ret(cudaErrorInvalidDevice) : cudaSuccess;
}

RT_API cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
    static int said;
    cudaError_t e = flags ? rt_ret(cudaErrorInvalidValue) : peer_check(peer);
    if (e) return e;
    if (!said++) fprintf(stderr, "rgpu: cudaDeviceEnablePeerAccess between two devices is not supported over rgpu "
                                 "(the server does not run cuCtxEnablePeerAccess)\n");
    return rt_ret(cudaErrorPeerAccessUnsupported);
}

RT_API cudaError_t cudaDeviceDisablePeerAccess(int peer) {
    cudaError_t e = peer_check(peer);
    return e ? e : rt_ret(cudaErrorPeerAccessNotEnabled);
}

RT_API cudaError_t cudaDeviceSynchronize(void) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu_sync(cuCtxSynchronize());
}

RT_API cudaError_t cudaDeviceReset(void) {
    int dev = rt_device();
    cudaError_t e = rt_init();
    if (e) return rt_ret(e);
    cuCtxSynchronize();
    pthread_mutex_lock(&rt_lock);
    CUcontext was = rt_prim[dev];
    rt_prim[dev] = NULL;
    pthread_mutex_unlock(&rt_lock);
    if (!was) return cudaSuccess;
    if (rt_bound == was) { cuCtxSetCurrent(NULL); rt_bound = NULL; }
    rt_sticky_error = cudaSuccess;
    rt_last = cudaSuccess;
    return rt_cu(cuDevicePrimaryCtxReset(dev));
}

RT_API cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuCtxGetStreamPriorityRange(least, greatest));
}

RT_API cudaError_t cudaDeviceGetLimit(size_t *value, enum cudaLimit limit) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuCtxGetLimit(value, (CUlimit)limit));
}

RT_API cudaError_t cudaDeviceSetLimit(enum cudaLimit limit, size_t value) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuCtxSetLimit((CUlimit)limit, value));
}

RT_API cudaError_t cudaDeviceGetCacheConfig(enum cudaFuncCache *config) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuCtxGetCacheConfig((CUfunc_cache *)config));
}

RT_API cudaError_t cudaDeviceSetCacheConfig(enum cudaFuncCache config) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuCtxSetCacheConfig((CUfunc_cache)config));
}

/* ---- properties: CUDA 13's cudaDeviceProp, built once per device ------------------------- */
static int attr(int dev, CUdevice_attribute a) {
    int v = 0;
    return cuDeviceGetAttribute(&v, a, dev) == CUDA_SUCCESS ? v : 0;
}

static struct cudaDeviceProp *rt_build_props(int dev) {
    struct cudaDeviceProp *p = calloc(1, sizeof *p);
    size_t total = 0;
    if (!p) return NULL;
    cuDeviceGetName(p->name, sizeof p->name, dev);
    cuDeviceGetUuid_v2((CUuuid *)&p->uuid, dev);
    cuDeviceTotalMem(&total, dev);
    p->totalGlobalMem = total;
#define A(field, name) p->field = attr(dev, CU_DEVICE_ATTRIBUTE_##name)
    A(sharedMemPerBlock, MAX_SHARED_MEMORY_PER_BLOCK); A(regsPerBlock, MAX_REGISTERS_PER_BLOCK);
    A(warpSize, WARP_SIZE); A(memPitch, MAX_PITCH); A(maxThreadsPerBlock, MAX_THREADS_PER_BLOCK);
    A(maxThreadsDim[0], MAX_BLOCK_DIM_X); A(maxThreadsDim[1], MAX_BLOCK_DIM_Y); A(maxThreadsDim[2], MAX_BLOCK_DIM_Z);
    A(maxGridSize[0], MAX_GRID_DIM_X); A(maxGridSize[1], MAX_GRID_DIM_Y); A(maxGridSize[2], MAX_GRID_DIM_Z);
    A(totalConstMem, TOTAL_CONSTANT_MEMORY); A(major, COMPUTE_CAPABILITY_MAJOR); A(minor, COMPUTE_CAPABILITY_MINOR);
    A(textureAlignment, TEXTURE_ALIGNMENT); A(texturePitchAlignment, TEXTURE_PITCH_ALIGNMENT);
    A(multiProcessorCount, MULTIPROCESSOR_COUNT); A(integrated, INTEGRATED); A(canMapHostMemory, CAN_MAP_HOST_MEMORY);
    A(maxTexture1D, MAXIMUM_TEXTURE1D_WIDTH); A(maxTexture1DMipmap, MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH);
    A(maxTexture2D[0], MAXIMUM_TEXTURE2D_WIDTH); A(maxTexture2D[1], MAXIMUM_TEXTURE2D_HEIGHT);
    A(maxTexture3D[0], MAXIMUM_TEXTURE3D_WIDTH); A(maxTexture3D[1], MAXIMUM_TEXTURE3D_HEIGHT);
    A(maxTexture3D[2], MAXIMUM_TEXTURE3D_DEPTH); A(maxTextureCubemap, MAXIMUM_TEXTURECUBEMAP_WIDTH);
    A(maxSurface1D, MAXIMUM_SURFACE1D_WIDTH); A(maxSurface2D[0], MAXIMUM_SURFACE2D_WIDTH);
    A(maxSurface2D[1], MAXIMUM_SURFACE2D_HEIGHT); A(surfaceAlignment, SURFACE_ALIGNMENT);
    A(concurrentKernels, CONCURRENT_KERNELS); A(ECCEnabled, ECC_ENABLED); A(pciBusID, PCI_BUS_ID);
    A(pciDeviceID, PCI_DEVICE_ID); A(pciDomainID, PCI_DOMAIN_ID); A(tccDriver, TCC_DRIVER);
    A(asyncEngineCount, ASYNC_ENGINE_COUNT); A(unifiedAddressing, UNIFIED_ADDRESSING);
    A(memoryBusWidth, GLOBAL_MEMORY_BUS_WIDTH); A(l2CacheSize, L2_CACHE_SIZE);
    A(persistingL2CacheMaxSize, MAX_PERSISTING_L2_CACHE_SIZE);
    A(maxThreadsPerMultiProcessor, MAX_THREADS_PER_MULTIPROCESSOR);
    A(streamPrioritiesSupported, STREAM_PRIORITIES_SUPPORTED); A(globalL1CacheSupported, GLOBAL_L1_CACHE_SUPPORTED);
    A(localL1CacheSupported, LOCAL_L1_CACHE_SUPPORTED);
    A(sharedMemPerMultiprocessor, MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
    A(regsPerMultiprocessor, MAX_REGISTERS_PER_MULTIPROCESSOR); A(managedMemory, MANAGED_MEMORY);
    A(isMultiGpuBoard, MULTI_GPU_BOARD); A(multiGpuBoardGroupID, MULTI_GPU_BOARD_GROUP_ID);
    A(hostNativeAtomicSupported, HOST_NATIVE_ATOMIC_SUPPORTED); A(pageableMemoryAccess, PAGEABLE_MEMORY_ACCESS);
    A(concurrentManagedAccess, CONCURRENT_MANAGED_ACCESS); A(computePreemptionSupported, COMPUTE_PREEMPTION_SUPPORTED);
    A(canUseHostPointerForRegisteredMem, CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM);
    A(cooperativeLaunch, COOPERATIVE_LAUNCH); A(sharedMemPerBlockOptin, MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    A(pageableMemoryAccessUsesHostPageTables, PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES);
    A(directManagedMemAccessFromHost, DIRECT_MANAGED_MEM_ACCESS_FROM_HOST);
    A(maxBlocksPerMultiProcessor, MAX_BLOCKS_PER_MULTIPROCESSOR);
    A(accessPolicyMaxWindowSize, MAX_ACCESS_POLICY_WINDOW_SIZE);
    A(reservedSharedMemPerBlock, RESERVED_SHARED_MEMORY_PER_BLOCK);
    A(hostRegisterSupported, HOST_REGISTER_SUPPORTED); A(sparseCudaArraySupported, SPARSE_CUDA_ARRAY_SUPPORTED);
    A(hostRegisterReadOnlySupported, READ_ONLY_HOST_REGISTER_SUPPORTED);
    A(timelineSemaphoreInteropSupported, TIMELINE_SEMAPHORE_INTEROP_SUPPORTED);
    A(memoryPoolsSupported, MEMORY_POOLS_SUPPORTED); A(gpuDirectRDMASupported, GPU_DIRECT_RDMA_SUPPORTED);
    A(gpuDirectRDMAFlushWritesOptions, GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS);
    A(gpuDirectRDMAWritesOrdering, GPU_DIRECT_RDMA_WRITES_ORDERING);
    A(memoryPoolSupportedHandleTypes, MEMPOOL_SUPPORTED_HANDLE_TYPES);
    A(deferredMappingCudaArraySupported, DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED);
    A(ipcEventSupported, IPC_EVENT_SUPPORTED); A(clusterLaunch, CLUSTER_LAUNCH);
    A(unifiedFunctionPointers, UNIFIED_FUNCTION_POINTERS); A(deviceNumaConfig, NUMA_CONFIG);
    A(deviceNumaId, NUMA_ID); A(mpsEnabled, MPS_ENABLED); A(hostNumaId, HOST_NUMA_ID);
    A(gpuPciDeviceID, GPU_PCI_DEVICE_ID); A(gpuPciSubsystemID, GPU_PCI_SUBSYSTEM_ID);
    A(hostNumaMultinodeIpcSupported, HOST_NUMA_MULTINODE_IPC_SUPPORTED);
#undef A
    return p;
}

RT_API cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    cudaError_t e = rt_init();
    if (e) return rt_ret(e);
    if (!prop) return rt_ret(cudaErrorInvalidValue);
    if (device < 0 || device >= rt_ndev) return rt_ret(cudaErrorInvalidDevice);
    if (!rt_props[device]) {
        struct cudaDeviceProp *p = rt_build_props(device);
        if (!p) return rt_ret(cudaErrorMemoryAllocation);
        pthread_mutex_lock(&rt_lock);
        if (!rt_props[device]) rt_props[device] = p; else free(p);
        pthread_mutex_unlock(&rt_lock);
    }
    *prop = *rt_props[device];
    return cudaSuccess;
}

RT_API cudaError_t cudaChooseDevice(int *device, const struct cudaDeviceProp *prop) {
    (void)prop;
    if (!device) return rt_ret(cudaErrorInvalidValue);
    *device = 0;                          /* every remote device is offered alike */
    return rt_ret(rt_init());
}

/* ---- versions, entry points, profiler ---------------------------------------------------- */
RT_API cudaError_t cudaDriverGetVersion(int *version) {
    if (!version) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_init();
    *version = 0;
    return e ? rt_ret(e) : rt_cu(cuDriverGetVersion(version));
}

RT_API cudaError_t cudaRuntimeGetVersion(int *version) {
    if (!version) return rt_ret(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

static cudaError_t entry_point(const char *symbol, void **fn, unsigned version, unsigned long long flags,
                               enum cudaDriverEntryPointQueryResult *status, int per_thread) {
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    cuuint64_t f = flags & cudaEnablePerThreadDefaultStream ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                 : flags & cudaEnableLegacyStream ? CU_GET_PROC_ADDRESS_LEGACY_STREAM
                 : per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
    cudaError_t e = rt_init();
    if (e) return rt_ret(e);
    if (!symbol || !fn) return rt_ret(cudaErrorInvalidValue);
    CUresult r = cuGetProcAddress_v2(symbol, fn, (int)version, f, &st);
    if (status) *status = (enum cudaDriverEntryPointQueryResult)st;
    /* as the stock runtime: a symbol not found is a status, not an error */
    return r == CUDA_ERROR_NOT_FOUND ? cudaSuccess : rt_cu(r);
}

RT_API cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags,
                                           enum cudaDriverEntryPointQueryResult *status) {
    return entry_point(symbol, fn, CUDA_VERSION, flags, status, 0);
}

RT_API cudaError_t cudaGetDriverEntryPoint_ptsz(const char *symbol, void **fn, unsigned long long flags,
                                                enum cudaDriverEntryPointQueryResult *status) {
    return entry_point(symbol, fn, CUDA_VERSION, flags, status, 1);
}

RT_API cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                                    unsigned long long flags,
                                                    enum cudaDriverEntryPointQueryResult *status) {
    return entry_point(symbol, fn, version, flags, status, 0);
}

RT_API cudaError_t cudaGetDriverEntryPointByVersion_ptsz(const char *symbol, void **fn, unsigned int version,
                                                         unsigned long long flags,
                                                         enum cudaDriverEntryPointQueryResult *status) {
    return entry_point(symbol, fn, version, flags, status, 1);
}

RT_API cudaError_t cudaProfilerStart(void) { return cudaSuccess; }   /* profiling runs on the server's host */
RT_API cudaError_t cudaProfilerStop(void) { return cudaSuccess; }

RT_API struct cudaChannelFormatDesc cudaCreateChannelDesc(int x, int y, int z, int w, enum cudaChannelFormatKind f) {
    struct cudaChannelFormatDesc d = {x, y, z, w, f};
    return d;
}
