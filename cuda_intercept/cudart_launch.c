/* rgpu's libcudart.so.13: registration as nvcc 13 emits it, kernel handles, launches, the call-configuration
 * stack (function attributes, occupancy and symbols are cudart_code.c's).
 *
 * Registration only fills C tables (torch registers 444 fatbins, 21,495
 * kernels and 12,884 variables at import: nothing may cross the network
 * then).  A fatbin is loaded as a CUlibrary at the first use of one of its
 * kernels or variables; the server keeps images by content.  Launches go to
 * cuLaunchKernel with the CUkernel handle, which libcuda.so.1 queues in C
 * from the layout it noted at cuLibraryGetKernel.
 */
#include "cudart_internal.h"

#define FATBIN_WRAPPER_MAGIC 0x466243b1u
#define RT_MAX_CONFIG_DEPTH 32

struct rt_fatbin { const void *image; CUlibrary lib; CUresult error; int loaded; };
struct rt_func { const void *host; struct rt_fatbin *fb; const char *name; CUkernel k; struct cudaFuncAttributes *attrs; };
struct rt_var { const void *host; struct rt_fatbin *fb; const char *name; size_t size; CUdeviceptr dptr; int managed; };

/* Open addressing on pointer keys, at most half full; entries are never removed (immortal tables:
 * calls arrive from late destructors at exit). */
struct rt_map { const void **keys; void **vals; size_t cap, len; };
static struct rt_map rt_funcs, rt_vars, rt_kernels;      /* host stub, host variable, CUkernel -> entry */
static pthread_mutex_t rt_reg = PTHREAD_MUTEX_INITIALIZER;

static size_t slot(const struct rt_map *m, const void *key) {
    uintptr_t h = (uintptr_t)key;
    h ^= h >> 17; h *= 0x9E3779B97F4A7C15ull;
    for (size_t i = (h >> 7) & (m->cap - 1);; i = (i + 1) & (m->cap - 1))
        if (m->keys[i] == key || !m->keys[i]) return i;
}

static void *map_get(const struct rt_map *m, const void *key) {
    if (!m->cap || !key) return NULL;
    size_t i = slot(m, key);
    return m->keys[i] ? m->vals[i] : NULL;
}

static int map_put(struct rt_map *m, const void *key, void *val) {
    if (2 * (m->len + 1) > m->cap) {
        struct rt_map n = {calloc(m->cap ? 2 * m->cap : 1024, sizeof(void *)), NULL, m->cap ? 2 * m->cap : 1024, 0};
        n.vals = calloc(n.cap, sizeof(void *));
        if (!n.keys || !n.vals) { free(n.keys); free(n.vals); return 0; }
        for (size_t i = 0; i < m->cap; i++)
            if (m->keys[i]) { size_t j = slot(&n, m->keys[i]); n.keys[j] = m->keys[i]; n.vals[j] = m->vals[i]; n.len++; }
        free(m->keys); free(m->vals);
        *m = n;
    }
    size_t i = slot(m, key);
    if (!m->keys[i]) m->len++;
    m->keys[i] = key;
    m->vals[i] = val;
    return 1;
}

/* ---- registration: C tables only ---------------------------------------------------------- */
RT_API void **__cudaRegisterFatBinary(void *fatCubin) {
    struct rt_fatbin *fb = calloc(1, sizeof *fb);
    const struct { int magic, version; const void *data; void *filename; } *w = fatCubin;
    if (!fb) return NULL;
    /* nvcc passes a wrapper {magic 0x466243b1, version, data -> the fatbin 0xBA55ED50}; a bare image is taken too */
    fb->image = w && (unsigned)w->magic == FATBIN_WRAPPER_MAGIC ? w->data : fatCubin;
    return (void **)fb;
}

RT_API void __cudaRegisterFatBinaryEnd(void **handle) { (void)handle; }
RT_API char __cudaInitModule(void **handle) { (void)handle; return 1; }

/* The session's end frees the server's copy; a late unregister at exit must not reach the network. */
RT_API void __cudaUnregisterFatBinary(void **handle) { (void)handle; }

RT_API void __cudaRegisterFunction(void **handle, const char *hostFun, char *deviceFun, const char *deviceName,
                                   int thread_limit, uint3 *tid, uint3 *bid, dim3 *bDim, dim3 *gDim, int *wSize) {
    struct rt_func *f = calloc(1, sizeof *f);
    (void)deviceName; (void)thread_limit; (void)tid; (void)bid; (void)bDim; (void)gDim; (void)wSize;
    if (!f) return;
    *f = (struct rt_func){hostFun, (struct rt_fatbin *)handle, deviceFun, NULL, NULL};
    pthread_mutex_lock(&rt_reg);
    map_put(&rt_funcs, hostFun, f);
    pthread_mutex_unlock(&rt_reg);
}

static void register_var(void **handle, const void *host, const char *name, size_t size, int managed) {
    struct rt_var *v = calloc(1, sizeof *v);
    if (!v) return;
    *v = (struct rt_var){host, (struct rt_fatbin *)handle, name, size, 0, managed};
    pthread_mutex_lock(&rt_reg);
    map_put(&rt_vars, host, v);
    pthread_mutex_unlock(&rt_reg);
}

RT_API void __cudaRegisterVar(void **handle, char *hostVar, char *deviceAddress, const char *deviceName, int ext,
                              size_t size, int constant, int global) {
    (void)deviceAddress; (void)ext; (void)constant; (void)global;
    register_var(handle, hostVar, deviceName, size, 0);
}

/* Managed variables are noted so that their use is refused by name, not met as an unknown symbol. */
RT_API void __cudaRegisterManagedVar(void **handle, void **hostVarPtrAddress, char *deviceAddress,
                                     const char *deviceName, int ext, size_t size, int constant, int global) {
    (void)deviceAddress; (void)ext; (void)constant; (void)global;
    register_var(handle, hostVarPtrAddress, deviceName, size, 1);
}

/* Undocumented registrations the stock runtime exports (no nvcc 13 output we build calls them): accepted, unused. */
RT_API void __cudaRegisterHostVar(void **handle, const char *deviceName, char *hostVar, size_t size) {
    (void)handle; (void)deviceName; (void)hostVar; (void)size;
}
RT_API void __cudaRegisterUnifiedTable(void **handle) { (void)handle; }

RT_API cudaError_t __cudaGetProcAddress(void) {
    static int said;
    if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
        fprintf(stderr, "rgpu: __cudaGetProcAddress is not supported over rgpu (yet)\n");
    return rt_ret(cudaErrorNotSupported);
}

/* ---- loading at first use ---------------------------------------------------------------- */
static CUresult load(struct rt_fatbin *fb) {
    if (fb->loaded) return fb->error;
    pthread_mutex_lock(&rt_reg);
    if (!fb->loaded) {
        fb->error = cuLibraryLoadData(&fb->lib, fb->image, NULL, NULL, 0, NULL, NULL, 0);
        fb->loaded = 1;
    }
    pthread_mutex_unlock(&rt_reg);
    return fb->error;
}

static struct rt_func *func_of(const void *ptr) {
    pthread_mutex_lock(&rt_reg);
    struct rt_func *f = map_get(&rt_funcs, ptr);
    if (!f) f = map_get(&rt_kernels, ptr);      /* a cudaKernel_t handed back to us */
    pthread_mutex_unlock(&rt_reg);
    return f;
}

static CUresult kernel(struct rt_func *f, CUkernel *k) {
    CUresult r;
    if (f->k) { *k = f->k; return CUDA_SUCCESS; }
    if ((r = load(f->fb)) != CUDA_SUCCESS) return r;
    if ((r = cuLibraryGetKernel(k, f->fb->lib, f->name)) != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&rt_reg);
    f->k = *k;
    map_put(&rt_kernels, *k, f);
    pthread_mutex_unlock(&rt_reg);
    return CUDA_SUCCESS;
}

CUresult rt_kernel_of(const void *host_fun, CUkernel *k) {
    struct rt_func *f = func_of(host_fun);
    if (!f) return CUDA_ERROR_INVALID_HANDLE;    /* -> cudaErrorInvalidResourceHandle, below as InvalidDeviceFunction */
    return kernel(f, k);
}

CUresult rt_symbol(const void *symbol, CUdeviceptr *dptr, size_t *size) {
    CUresult r;
    pthread_mutex_lock(&rt_reg);
    struct rt_var *v = map_get(&rt_vars, symbol);
    pthread_mutex_unlock(&rt_reg);
    if (!v) return CUDA_ERROR_NOT_FOUND;
    if (v->managed) {
        fprintf(stderr, "rgpu: __managed__ variable %s is not supported over rgpu: managed memory cannot be shared "
                        "with a GPU across a network\n", v->name);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!v->dptr) {
        size_t n = 0;
        if ((r = load(v->fb)) != CUDA_SUCCESS) return r;
        if ((r = cuLibraryGetGlobal(&v->dptr, &n, v->fb->lib, v->name)) != CUDA_SUCCESS) return r;
        if (n) v->size = n;
    }
    if (dptr) *dptr = v->dptr;
    if (size) *size = v->size;
    return CUDA_SUCCESS;
}

/* A host function the runtime does not know is the program's mistake: cudaErrorInvalidDeviceFunction. */
cudaError_t rt_kernel(const void *func, CUkernel *k) {
    cudaError_t e = rt_ctx();
    if (e) return e;
    CUresult r = rt_kernel_of(func, k);
    return r == CUDA_ERROR_INVALID_HANDLE ? rt_ret(cudaErrorInvalidDeviceFunction) : rt_cu(r);
}

struct cudaFuncAttributes **rt_attrs_slot(const void *func) {
    struct rt_func *f = func_of(func);
    return f ? &f->attrs : NULL;
}

RT_API cudaError_t __cudaGetKernel(cudaKernel_t *out, const void *hostStub) {
    CUkernel k;
    if (!out) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_kernel(hostStub, &k);
    if (!e) *out = (cudaKernel_t)k;
    return e;
}

RT_API cudaError_t cudaGetKernel(cudaKernel_t *out, const void *entryFuncAddr) { return __cudaGetKernel(out, entryFuncAddr); }

RT_API cudaError_t cudaGetFuncBySymbol(cudaFunction_t *out, const void *symbolPtr) {
    CUkernel k;
    cudaError_t e = rt_kernel(symbolPtr, &k);
    return e ? e : rt_cu(cuKernelGetFunction((CUfunction *)out, k));
}

RT_API cudaError_t cudaFuncGetName(const char **name, const void *func) {
    struct rt_func *f = func_of(func);
    if (!name) return rt_ret(cudaErrorInvalidValue);
    if (!f) return rt_ret(cudaErrorInvalidDeviceFunction);
    *name = f->name;
    return cudaSuccess;
}

/* ---- launches ---------------------------------------------------------------------------- */
static cudaError_t launch_k(CUkernel k, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s, int pt) {
    cudaError_t e = rt_ctx();             /* a thread's first launch binds its device's primary context */
    if (e) return e;
    /* nvcc's stub launches whatever handle __cudaGetKernel left: NULL after a failed load, whose error stands */
    if (!k) return rt_ret(cudaPeekAtLastError() ? cudaPeekAtLastError() : cudaErrorInvalidDeviceFunction);
    return rt_cu(cuLaunchKernel((CUfunction)k, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)shmem, rt_stream(s, pt), args, NULL));
}

RT_API cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s) {
    return launch_k((CUkernel)k, g, b, args, shmem, s, 0);
}

RT_API cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t k, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s) {
    return launch_k((CUkernel)k, g, b, args, shmem, s, 1);
}

static cudaError_t launch_f(const void *func, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s, int pt) {
    CUkernel k;
    cudaError_t e = rt_kernel(func, &k);
    return e ? e : launch_k(k, g, b, args, shmem, s, pt);
}

RT_API cudaError_t cudaLaunchKernel(const void *func, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s) {
    return launch_f(func, g, b, args, shmem, s, 0);
}

RT_API cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s) {
    return launch_f(func, g, b, args, shmem, s, 1);
}

_Static_assert(sizeof(cudaLaunchAttribute) == sizeof(CUlaunchAttribute), "launch attributes differ in size");

static cudaError_t launch_ex(const cudaLaunchConfig_t *c, const void *func, void **args, int pt) {
    CUkernel k;
    if (!c) return rt_ret(cudaErrorInvalidValue);
    cudaError_t e = rt_kernel(func, &k);
    if (e) return e;
    /* cudaLaunchAttribute and CUlaunchAttribute share their layout and numbering */
    CUlaunchConfig cu = {c->gridDim.x, c->gridDim.y, c->gridDim.z, c->blockDim.x, c->blockDim.y, c->blockDim.z,
                         (unsigned)c->dynamicSmemBytes, rt_stream(c->stream, pt), (CUlaunchAttribute *)c->attrs,
                         c->numAttrs};
    return rt_cu(cuLaunchKernelEx(&cu, (CUfunction)k, args, NULL));
}

RT_API cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *c, const void *func, void **args) {
    return launch_ex(c, func, args, 0);
}

RT_API cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t *c, const void *func, void **args) {
    return launch_ex(c, func, args, 1);
}

static cudaError_t launch_coop(const void *func, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s, int pt) {
    cudaLaunchAttribute a = {0};
    a.id = cudaLaunchAttributeCooperative;
    a.val.cooperative = 1;
    cudaLaunchConfig_t c = {g, b, shmem, s, &a, 1};
    return launch_ex(&c, func, args, pt);
}

RT_API cudaError_t cudaLaunchCooperativeKernel(const void *f, dim3 g, dim3 b, void **args, size_t shmem, cudaStream_t s) {
    return launch_coop(f, g, b, args, shmem, s, 0);
}

RT_API cudaError_t cudaLaunchCooperativeKernel_ptsz(const void *f, dim3 g, dim3 b, void **args, size_t shmem,
                                                    cudaStream_t s) {
    return launch_coop(f, g, b, args, shmem, s, 1);
}

/* The <<<...>>> configuration: pushed by the call site, popped by the host stub; per thread. */
struct rt_config { dim3 grid, block; size_t shmem; cudaStream_t stream; };
static __thread struct rt_config rt_configs[RT_MAX_CONFIG_DEPTH];
static __thread int rt_nconfig;

RT_API unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shmem, struct CUstream_st *stream) {
    if (rt_nconfig >= RT_MAX_CONFIG_DEPTH) return 1;
    rt_configs[rt_nconfig++] = (struct rt_config){grid, block, shmem, (cudaStream_t)stream};
    return 0;
}

RT_API cudaError_t __cudaPopCallConfiguration(dim3 *grid, dim3 *block, size_t *shmem, void *stream) {
    if (!rt_nconfig) return rt_ret(cudaErrorMissingConfiguration);
    struct rt_config *c = &rt_configs[--rt_nconfig];
    *grid = c->grid;
    *block = c->block;
    *shmem = c->shmem;
    *(cudaStream_t *)stream = c->stream;
    return cudaSuccess;
}
