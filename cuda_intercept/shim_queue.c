/* Stream-ordered calls queued in C beside the launches: memsets, event records, stream waits, frees, small
 * host-to-device copies, device-to-device copies and graph launches, never waited for and never entering Python.
 *
 * Each becomes one record in shim_launch.c's queue, so its order with the launches around it is the order
 * the program made the calls in (layout: rgpu.protocol.cuda.OP):
 *   u32 size, u32 kind, u64 ctx, u64 stream, u64 a, u64 b, u64 c, then the kind's bytes.
 * Handles are the raw pointer values, as calls_memory.py / calls_order.py send them (handle() is a cast),
 * the context is the thread's current one (what client.post names), and a _ptsz form's NULL stream is the
 * per-thread one (registry._per_thread).  A failure comes back as a posted call's would: at the next
 * synchronising call.  Whatever C cannot say exactly (no context yet, before cuInit, RGPU_NATIVE=off,
 * a copy over RGPU_CUDA_QUEUED_COPY_BYTES) goes to Python, the reference.
 */
#define RGPU_OP_HEADER ((size_t)RGPU_CUDA_OP_HEADER_BYTES)
#define RGPU_NO_STREAM ((uint64_t)RGPU_CUDA_NO_STREAM)

static volatile int rgpu_records_on = 1;    /* Python sets it from RGPU_NATIVE (off: every call posts) */
static void rgpu_records_native(int on) { rgpu_records_on = on; }

/* Whether this call may be queued here rather than posted by Python. */
static int rgpu_queueing(void) {
    return rgpu_initialized && rgpu_records_on && !rgpu_finalized && rgpu_ctx_current();
}

static CUresult rgpu_queue_op(uint32_t kind, uint64_t stream, uint64_t a, uint64_t b, uint64_t c,
                              const void *data, size_t n) {
    uint64_t head[5] = {rgpu_ctx_current(), stream, a, b, c};
    size_t size = (RGPU_OP_HEADER + n + 7) & ~(size_t)7;
    pthread_mutex_lock(&rgpu_lock);
    char *r = rgpu_q_reserve(size);
    if (!r) { pthread_mutex_unlock(&rgpu_lock); return CUDA_ERROR_OUT_OF_MEMORY; }
    uint32_t head32[2] = {(uint32_t)size, kind};
    memcpy(r, head32, 8);
    memcpy(r + 8, head, sizeof head);
    if (n) memcpy(r + RGPU_OP_HEADER, data, n);
    memset(r + RGPU_OP_HEADER + n, 0, size - RGPU_OP_HEADER - n);
    int flush = rgpu_q_commit(size);
    pthread_mutex_unlock(&rgpu_lock);
    return flush ? _py_rgpu_flush() : CUDA_SUCCESS;   /* a full queue is posted (Python, once per RGPU_CUDA_QUEUE_BYTES) */
}

#define RGPU_S(s) ((uint64_t)(uintptr_t)(s))
#define RGPU_PT(s) ((s) ? RGPU_S(s) : RGPU_S(RGPU_STREAM_PER_THREAD))

/* ---- memsets: value | element bytes << 32 -------------------------------------------------------- */
static CUresult rgpu_memset(CUdeviceptr dst, uint32_t value, uint64_t elem, size_t n, uint64_t stream) {
    if (!rgpu_queueing()) return RGPU_PY;
    if (!n) return CUDA_SUCCESS;                       /* Python posts nothing for an empty memset either */
    return rgpu_queue_op(RGPU_CUDA_REC_MEMSET, stream, dst, value | elem << 32, n, NULL, 0);
}

static CUresult rgpu_fast_cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return rgpu_memset(d, v, 1, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { return rgpu_memset(d, v, 2, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) { return rgpu_memset(d, v, 4, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n) { return rgpu_memset(d, v, 1, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short v, size_t n) { return rgpu_memset(d, v, 2, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n) { return rgpu_memset(d, v, 4, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { return rgpu_memset(d, v, 1, n, RGPU_S(s)); }
static CUresult rgpu_fast_cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s) { return rgpu_memset(d, v, 2, n, RGPU_S(s)); }
static CUresult rgpu_fast_cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) { return rgpu_memset(d, v, 4, n, RGPU_S(s)); }
static CUresult rgpu_fast_cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { return rgpu_memset(d, v, 1, n, RGPU_PT(s)); }
static CUresult rgpu_fast_cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short v, size_t n, CUstream s) { return rgpu_memset(d, v, 2, n, RGPU_PT(s)); }
static CUresult rgpu_fast_cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream s) { return rgpu_memset(d, v, 4, n, RGPU_PT(s)); }

/* ---- events and waits ------------------------------------------------------------------------------ */
static CUresult rgpu_event_record(CUevent e, uint64_t stream, unsigned flags) {
    if (!rgpu_queueing()) return RGPU_PY;
    return rgpu_queue_op(RGPU_CUDA_REC_EVENT_RECORD, stream, RGPU_S(e), flags, 0, NULL, 0);
}

static CUresult rgpu_fast_cuEventRecord(CUevent e, CUstream s) { return rgpu_event_record(e, RGPU_S(s), 0); }
static CUresult rgpu_fast_cuEventRecord_ptsz(CUevent e, CUstream s) { return rgpu_event_record(e, RGPU_PT(s), 0); }
static CUresult rgpu_fast_cuEventRecordWithFlags(CUevent e, CUstream s, unsigned f) { return rgpu_event_record(e, RGPU_S(s), f); }
static CUresult rgpu_fast_cuEventRecordWithFlags_ptsz(CUevent e, CUstream s, unsigned f) { return rgpu_event_record(e, RGPU_PT(s), f); }

static CUresult rgpu_stream_wait(uint64_t stream, CUevent e, unsigned flags) {
    if (!rgpu_queueing()) return RGPU_PY;
    return rgpu_queue_op(RGPU_CUDA_REC_STREAM_WAIT, stream, RGPU_S(e), flags, 0, NULL, 0);
}

static CUresult rgpu_fast_cuStreamWaitEvent(CUstream s, CUevent e, unsigned f) { return rgpu_stream_wait(RGPU_S(s), e, f); }
static CUresult rgpu_fast_cuStreamWaitEvent_ptsz(CUstream s, CUevent e, unsigned f) { return rgpu_stream_wait(RGPU_PT(s), e, f); }

/* ---- frees: the allocation table (shim_ptr.c) forgets the pointer here, as Python's free does --------- */
static CUresult rgpu_free(CUdeviceptr p, uint64_t stream) {
    if (!rgpu_queueing()) return RGPU_PY;
    if (!rgpu_alloc_forget(p)) return p ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    return rgpu_queue_op(RGPU_CUDA_REC_MEM_FREE, stream, p, 0, 0, NULL, 0);
}

static CUresult rgpu_fast_cuMemFree_v2(CUdeviceptr p) { return rgpu_free(p, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemFreeAsync(CUdeviceptr p, CUstream s) { return rgpu_free(p, RGPU_S(s)); }
static CUresult rgpu_fast_cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return rgpu_free(p, RGPU_PT(s)); }

/* ---- small host-to-device copies: the bytes go into the record (the host buffer may change after the
 * call returns, as with a posted copy); a bigger one keeps its own messages, in pieces, with no copy here -- */
static CUresult rgpu_htod_async(CUdeviceptr dst, const void *src, size_t n, uint64_t stream) {
    if (!rgpu_queueing() || n > RGPU_CUDA_QUEUED_COPY_BYTES || (n && !src)) return RGPU_PY;
    if (!n) return CUDA_SUCCESS;
    return rgpu_queue_op(RGPU_CUDA_REC_MEMCPY_HTOD, stream, dst, n, 0, src, n);
}

static CUresult rgpu_fast_cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *src, size_t n, CUstream s) { return rgpu_htod_async(d, src, n, RGPU_S(s)); }
static CUresult rgpu_fast_cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *src, size_t n, CUstream s) { return rgpu_htod_async(d, src, n, RGPU_PT(s)); }

/* ---- device-to-device copies: nothing on the host to keep, so any size --------------------------------- */
static CUresult rgpu_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, uint64_t stream) {
    if (!rgpu_queueing()) return RGPU_PY;
    if (!n) return CUDA_SUCCESS;                       /* Python posts nothing for an empty copy either */
    return rgpu_queue_op(RGPU_CUDA_REC_MEMCPY_DTOD, stream, dst, src, n, NULL, 0);
}

static CUresult rgpu_fast_cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return rgpu_dtod(d, s, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { return rgpu_dtod(d, s, n, RGPU_NO_STREAM); }
static CUresult rgpu_fast_cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return rgpu_dtod(d, s, n, RGPU_S(st)); }
static CUresult rgpu_fast_cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return rgpu_dtod(d, s, n, RGPU_PT(st)); }

/* ---- graph launches -------------------------------------------------------------------------------- */
static CUresult rgpu_graph_launch(CUgraphExec g, uint64_t stream) {
    if (!rgpu_queueing()) return RGPU_PY;
    return rgpu_queue_op(RGPU_CUDA_REC_GRAPH_LAUNCH, stream, RGPU_S(g), 0, 0, NULL, 0);
}

static CUresult rgpu_fast_cuGraphLaunch(CUgraphExec g, CUstream s) { return rgpu_graph_launch(g, RGPU_S(s)); }
static CUresult rgpu_fast_cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return rgpu_graph_launch(g, RGPU_PT(s)); }

/* ---- synchronisations answered here, with no round trip -------------------------------------------
 * The rule: the server answers a stream-ordered copy to the host (memcpy_dtoh on a stream: the copy, then
 * cuStreamSynchronize of that stream, before the reply), a stream synchronisation and a context one only once
 * the work they wait for is done.  Python notes that proof here with the generation it was sent at; every
 * record queued and every message Python sends moves the generation on.  While it has not moved, nothing can
 * have been given to the GPU since (on any stream: the legacy default stream's implicit waits need no
 * thought), so a second synchronisation of the same stream (or query: it is complete), or of the same context,
 * is answered CUDA_SUCCESS here.  An earlier queued call's failure is never lost: it came with the proving
 * reply, which raised it, and a proof is noted only when no failure is pending.  Anything else goes to Python.
 */
struct rgpu_idle { uint64_t ctx, stream, gen; };
static struct rgpu_idle rgpu_idle_s, rgpu_idle_c; /* the stream, and the context, last shown idle (ctx 0: none) */

/* Python sends a message: the generation it goes out at. */
static uint64_t rgpu_work_note(void) {
    pthread_mutex_lock(&rgpu_lock);
    uint64_t g = ++rgpu_work_gen;
    pthread_mutex_unlock(&rgpu_lock);
    return g;
}

/* The server showed `stream` of `ctx` idle (RGPU_NO_STREAM: the whole context) in the reply to a message
 * sent at generation `gen`. */
static void rgpu_idle_note(uint64_t ctx, uint64_t stream, uint64_t gen) {
    pthread_mutex_lock(&rgpu_lock);
    if (gen == rgpu_work_gen && ctx) {
        if (stream == RGPU_NO_STREAM) rgpu_idle_c = (struct rgpu_idle){ctx, stream, gen};
        else rgpu_idle_s = (struct rgpu_idle){ctx, stream, gen};
    }
    pthread_mutex_unlock(&rgpu_lock);
}

/* CUDA_SUCCESS when `stream` (RGPU_NO_STREAM: the context) of the current context is known idle, else RGPU_PY. */
static CUresult rgpu_idle(uint64_t stream) {
    if (!rgpu_queueing()) return RGPU_PY;
    uint64_t ctx = rgpu_ctx_current();
    pthread_mutex_lock(&rgpu_lock);
    int s = rgpu_idle_s.ctx == ctx && rgpu_idle_s.stream == stream && rgpu_idle_s.gen == rgpu_work_gen;
    /* the whole context idle: its legacy and per-thread default streams too (other streams' contexts are
     * not known here) */
    int c = rgpu_idle_c.ctx == ctx && rgpu_idle_c.gen == rgpu_work_gen &&
            (stream == RGPU_NO_STREAM || stream == 0 || stream == RGPU_S(RGPU_STREAM_PER_THREAD));
    pthread_mutex_unlock(&rgpu_lock);
    return s || c ? CUDA_SUCCESS : RGPU_PY;
}

static CUresult rgpu_fast_cuStreamSynchronize(CUstream s) { return rgpu_idle(RGPU_S(s)); }
static CUresult rgpu_fast_cuStreamSynchronize_ptsz(CUstream s) { return rgpu_idle(RGPU_PT(s)); }
static CUresult rgpu_fast_cuStreamQuery(CUstream s) { return rgpu_idle(RGPU_S(s)); }
static CUresult rgpu_fast_cuStreamQuery_ptsz(CUstream s) { return rgpu_idle(RGPU_PT(s)); }
static CUresult rgpu_fast_cuCtxSynchronize(void) { return rgpu_idle(RGPU_NO_STREAM); }
