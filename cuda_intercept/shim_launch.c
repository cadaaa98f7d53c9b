/* Kernel launches, queued in C: arguments packed by the server's layout, records batched for Python to post.
 * (The queue's other records -- memsets, events, waits, frees, small copies -- are shim_queue.c's.)
 *
 * Python notes each function's parameter layout (offsets and sizes, read on
 * the server with cuFuncGetParamInfo) when the program looks the function up.
 * A cuLaunchKernel with kernelParams then becomes one record in a buffer that
 * Python takes (rgpu_queue_take) and posts before anything else it sends, so
 * the order the program made its calls in is the order the server runs them.
 * Record (little-endian, 8-byte aligned; the server's cuda route reads it):
 *   u32 size, u32 kind, u64 func, u64 ctx, u64 stream,
 *   u32 grid[3], u32 block[3], u32 shared_bytes, u32 arg_bytes, u8 args[arg_bytes]
 */
#define RGPU_REC_HEADER ((uint32_t)RGPU_CUDA_LAUNCH_HEADER_BYTES)

struct rgpu_layout { uint64_t func; uint32_t nparams, argbytes; uint32_t *offsets, *sizes; };
static struct rgpu_layout *rgpu_funcs;  /* open addressing, key 0 = empty */
static size_t rgpu_funcs_cap, rgpu_funcs_len;
static char *rgpu_q;
static size_t rgpu_q_len, rgpu_q_cap, rgpu_q_count;
/* When a full queue is posted: at rgpu_q_next bytes, which starts at rgpu_q_first once a message took the queue
 * part-full (a wait, a call Python sends: the server may have run out of work meanwhile) and doubles at each
 * post of a full queue, up to rgpu_q_limit. So the first records after a wait reach the server soon and the
 * GPU starts while the client goes on queueing, and later posts, with the GPU busy, are few.
 * RGPU_CUDA_QUEUE_FIRST_BYTES and RGPU_CUDA_QUEUE_BYTES (embed.py sets them). */
static size_t rgpu_q_first = 64 << 10, rgpu_q_next = 64 << 10, rgpu_q_limit = 64 << 10;
static uint64_t rgpu_work_gen;     /* moved on by every record and every message sent (rgpu_lock): shim_queue.c */

static struct rgpu_layout *rgpu_find(uint64_t func) {
    if (!rgpu_funcs_cap) return NULL;
    for (size_t i = (func >> 4) & (rgpu_funcs_cap - 1);; i = (i + 1) & (rgpu_funcs_cap - 1)) {
        if (rgpu_funcs[i].func == func) return &rgpu_funcs[i];
        if (!rgpu_funcs[i].func) return NULL;
    }
}

static void rgpu_insert(struct rgpu_layout *table, size_t cap, struct rgpu_layout e) {
    size_t i = (e.func >> 4) & (cap - 1);
    while (table[i].func && table[i].func != e.func) i = (i + 1) & (cap - 1);
    table[i] = e;
}

static void rgpu_func_note(uint64_t func, uint32_t nparams, const uint32_t *offsets,
                           const uint32_t *sizes, uint32_t argbytes) {
    struct rgpu_layout e = {func, nparams, argbytes, malloc(4 * (nparams + 1)), malloc(4 * (nparams + 1))};
    memcpy(e.offsets, offsets, 4 * nparams);
    memcpy(e.sizes, sizes, 4 * nparams);
    pthread_mutex_lock(&rgpu_lock);
    if (2 * (rgpu_funcs_len + 1) > rgpu_funcs_cap) {      /* keep the table at most half full */
        size_t cap = rgpu_funcs_cap ? 2 * rgpu_funcs_cap : 256;
        struct rgpu_layout *t = calloc(cap, sizeof *t);
        for (size_t i = 0; i < rgpu_funcs_cap; i++)
            if (rgpu_funcs[i].func) rgpu_insert(t, cap, rgpu_funcs[i]);
        free(rgpu_funcs);
        rgpu_funcs = t;
        rgpu_funcs_cap = cap;
    }
    if (!rgpu_find(func)) rgpu_funcs_len++;
    rgpu_insert(rgpu_funcs, rgpu_funcs_cap, e);     /* a re-noted function keeps the old arrays: leaked, tiny */
    pthread_mutex_unlock(&rgpu_lock);
}

/* Hand the queued records to Python (which frees them with rgpu_queue_free). */
static char *rgpu_queue_take(size_t *len, size_t *count) {
    pthread_mutex_lock(&rgpu_lock);
    char *q = rgpu_q;
    *len = rgpu_q_len;
    *count = rgpu_q_count;
    if (rgpu_q_len < rgpu_q_next) rgpu_q_next = rgpu_q_first;          /* taken part-full: start again */
    else rgpu_q_next = 2 * rgpu_q_next < rgpu_q_limit ? 2 * rgpu_q_next : rgpu_q_limit;
    rgpu_q = NULL;
    rgpu_q_len = rgpu_q_cap = rgpu_q_count = 0;
    pthread_mutex_unlock(&rgpu_lock);
    return q;
}

static void rgpu_queue_free(char *q) { free(q); }
static void rgpu_queue_limit(size_t bytes, size_t first) {
    pthread_mutex_lock(&rgpu_lock);
    rgpu_q_limit = bytes;
    rgpu_q_first = rgpu_q_next = first < bytes ? first : bytes;
    pthread_mutex_unlock(&rgpu_lock);
}

static CUresult _py_rgpu_flush(void);

/* Room for a record of `size` bytes at the queue's end (call with rgpu_lock held); NULL when out of memory. */
static char *rgpu_q_reserve(size_t size) {
    if (rgpu_q_len + size > rgpu_q_cap) {
        size_t cap = rgpu_q_cap ? 2 * rgpu_q_cap : (64 << 10);
        while (cap < rgpu_q_len + size) cap *= 2;
        char *q = realloc(rgpu_q, cap);
        if (!q) return NULL;
        rgpu_q = q;
        rgpu_q_cap = cap;
    }
    return rgpu_q + rgpu_q_len;
}

/* The reserved record is written (rgpu_lock held): whether the queue is now full enough to post. */
static int rgpu_q_commit(size_t size) {
    rgpu_work_gen++;                 /* new work: no stream is known idle any more (shim_queue.c) */
    rgpu_q_len += size;
    rgpu_q_count++;
    return rgpu_q_len >= rgpu_q_next;
}

static CUresult rgpu_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, CUstream stream, void **params, void **extra) {
    uint64_t ctx = rgpu_ctx_current(), func = (uint64_t)(uintptr_t)f;
    int flush;
    /* anything unusual (extra, no params, zero sizes, no context) goes to Python, which explains it */
    if (!rgpu_initialized || !ctx || extra || !gx || !gy || !gz || !bx || !by || !bz) return RGPU_PY;
    pthread_mutex_lock(&rgpu_lock);
    struct rgpu_layout *l = rgpu_find(func);
    if (!l || (l->nparams && !params)) { pthread_mutex_unlock(&rgpu_lock); return RGPU_PY; }
    size_t size = (RGPU_REC_HEADER + l->argbytes + 7) & ~(size_t)7;
    char *r = rgpu_q_reserve(size);
    if (!r) { pthread_mutex_unlock(&rgpu_lock); return CUDA_ERROR_OUT_OF_MEMORY; }
    uint32_t head32[2] = {(uint32_t)size, RGPU_REC_LAUNCH};
    uint64_t head64[3] = {func, ctx, (uint64_t)(uintptr_t)stream};
    uint32_t dims[8] = {gx, gy, gz, bx, by, bz, shmem, l->argbytes};
    memcpy(r, head32, 8);
    memcpy(r + 8, head64, 24);
    memcpy(r + 32, dims, 32);
    memset(r + RGPU_REC_HEADER, 0, size - RGPU_REC_HEADER);
    for (uint32_t i = 0; i < l->nparams; i++)
        memcpy(r + RGPU_REC_HEADER + l->offsets[i], params[i], l->sizes[i]);
    flush = rgpu_q_commit(size);
    pthread_mutex_unlock(&rgpu_lock);
    return flush && !rgpu_finalized ? _py_rgpu_flush() : CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                         unsigned by, unsigned bz, unsigned shmem, CUstream s, void **p, void **e) {
    return rgpu_launch(f, gx, gy, gz, bx, by, bz, shmem, s, p, e);
}

/* The per-thread flavour: the NULL stream means the per-thread default stream. */
static CUresult rgpu_fast_cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                              unsigned by, unsigned bz, unsigned shmem, CUstream s, void **p, void **e) {
    return rgpu_launch(f, gx, gy, gz, bx, by, bz, shmem, s ? s : RGPU_STREAM_PER_THREAD, p, e);
}

/* cuLaunchKernelEx (Triton's launcher, the runtime's cudaLaunchKernelExC) queues here when its
 * configuration is plain: no attributes, or only CU_LAUNCH_ATTRIBUTE_IGNORE ones.  Clusters,
 * cooperative launches and the rest go to Python, which carries the attributes to the server. */
static CUresult rgpu_launch_ex(const CUlaunchConfig *c, CUfunction f, void **params, void **extra, int per_thread) {
    if (!c) return RGPU_PY;
    for (unsigned i = 0; i < c->numAttrs; i++)
        if (!c->attrs || c->attrs[i].id != CU_LAUNCH_ATTRIBUTE_IGNORE) return RGPU_PY;
    CUstream s = c->hStream ? c->hStream : per_thread ? RGPU_STREAM_PER_THREAD : NULL;
    return rgpu_launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                       c->sharedMemBytes, s, params, extra);
}

static CUresult rgpu_fast_cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    return rgpu_launch_ex(c, f, params, extra, 0);
}

static CUresult rgpu_fast_cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    return rgpu_launch_ex(c, f, params, extra, 1);
}
