/* Contexts, answered in C: each thread's context stack, and which device each context is on.
 *
 * The server holds the real contexts; every call Python forwards names the
 * caller's current one (rgpu_ctx_current), so switching contexts never costs
 * a round trip and cuCtxGetCurrent, which runtimes call constantly, is exact here.
 */
#define RGPU_MAX_CTX 1024

struct rgpu_ctx { uint64_t handle; int device; };
static struct rgpu_ctx rgpu_ctxs[RGPU_MAX_CTX];
static int rgpu_nctx;
static __thread uint64_t rgpu_stack[RGPU_MAX_CTX_DEPTH];
static __thread int rgpu_depth;

static int rgpu_ctx_device(uint64_t h) {
    int dev = -1;
    pthread_mutex_lock(&rgpu_lock);
    for (int i = 0; i < rgpu_nctx; i++)
        if (rgpu_ctxs[i].handle == h) { dev = rgpu_ctxs[i].device; break; }
    pthread_mutex_unlock(&rgpu_lock);
    return dev;
}

static int rgpu_ctx_note(uint64_t h, int device) {
    int ok = 1;
    if (rgpu_ctx_device(h) >= 0) return 1;
    pthread_mutex_lock(&rgpu_lock);
    if (rgpu_nctx < RGPU_MAX_CTX) rgpu_ctxs[rgpu_nctx++] = (struct rgpu_ctx){h, device};
    else ok = 0;
    pthread_mutex_unlock(&rgpu_lock);
    return ok;
}

/* Forget a destroyed context; popped from this thread's stack when on top. */
static void rgpu_ctx_forget(uint64_t h) {
    pthread_mutex_lock(&rgpu_lock);
    for (int i = 0; i < rgpu_nctx; i++)
        if (rgpu_ctxs[i].handle == h) { rgpu_ctxs[i] = rgpu_ctxs[--rgpu_nctx]; break; }
    pthread_mutex_unlock(&rgpu_lock);
    if (rgpu_depth > 0 && rgpu_stack[rgpu_depth - 1] == h) rgpu_depth--;
}

static uint64_t rgpu_ctx_current(void) {
    return rgpu_depth ? rgpu_stack[rgpu_depth - 1] : 0;
}

static CUresult rgpu_fast_cuCtxPushCurrent_v2(CUcontext ctx) {
    uint64_t h = (uint64_t)(uintptr_t)ctx;
    if (!rgpu_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!h || rgpu_ctx_device(h) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (rgpu_depth >= RGPU_MAX_CTX_DEPTH) return CUDA_ERROR_OUT_OF_MEMORY;
    rgpu_stack[rgpu_depth++] = h;
    return CUDA_SUCCESS;
}

/* Python's way in: cuCtxCreate makes the new context current. */
static int rgpu_ctx_push(uint64_t h) {
    return rgpu_fast_cuCtxPushCurrent_v2((CUcontext)(uintptr_t)h) == CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuCtxPopCurrent_v2(CUcontext *pctx) {
    if (!rgpu_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!rgpu_depth) return CUDA_ERROR_INVALID_CONTEXT;
    uint64_t h = rgpu_stack[--rgpu_depth];
    if (pctx) *pctx = (CUcontext)(uintptr_t)h;
    return CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuCtxSetCurrent(CUcontext ctx) {
    uint64_t h = (uint64_t)(uintptr_t)ctx;
    if (!rgpu_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!h) {                            /* NULL pops the top, if any */
        if (rgpu_depth) rgpu_depth--;
        return CUDA_SUCCESS;
    }
    if (rgpu_ctx_device(h) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (rgpu_depth) rgpu_stack[rgpu_depth - 1] = h;
    else rgpu_stack[rgpu_depth++] = h;
    return CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuCtxGetCurrent(CUcontext *pctx) {
    if (!rgpu_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)(uintptr_t)rgpu_ctx_current();
    return CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuCtxGetDevice(CUdevice *dev) {
    if (!rgpu_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    uint64_t h = rgpu_ctx_current();
    int d = h ? rgpu_ctx_device(h) : -1;
    if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = d;
    return CUDA_SUCCESS;
}
