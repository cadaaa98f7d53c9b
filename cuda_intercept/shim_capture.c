/* Stream capture and primary-context state, answered in C: the questions runtimes ask around every call.
 *
 * torch asks cuDevicePrimaryCtxGetState ~1,000 times and cuStreamIsCapturing
 * hundreds of times a step; both are facts of this process (it made the
 * retains and began the captures), so Python notes them here as it forwards
 * the calls that change them, and the questions never reach the server.
 * Capture ids are minted here, unique in the process as the driver's are.
 */
#define RGPU_MAX_DEV 64
#define RGPU_MAX_CAPTURES 256

struct rgpu_primary { int retains; unsigned flags; };
static struct rgpu_primary rgpu_prims[RGPU_MAX_DEV];

struct rgpu_capture { uint64_t stream, id, graph; };
static struct rgpu_capture rgpu_caps[RGPU_MAX_CAPTURES];
static int rgpu_ncaps;
static uint64_t rgpu_capture_ids;
static __thread CUstreamCaptureMode rgpu_capture_mode;      /* CU_STREAM_CAPTURE_MODE_GLOBAL (0) by default */

/* Python's record of a device's primary context: how many retains are outstanding, and its flags. */
static void rgpu_primary_note(int dev, int retains, unsigned flags) {
    if (dev < 0 || dev >= RGPU_MAX_DEV) return;
    pthread_mutex_lock(&rgpu_lock);
    rgpu_prims[dev] = (struct rgpu_primary){retains, flags};
    pthread_mutex_unlock(&rgpu_lock);
}

static CUresult rgpu_fast_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    if (!rgpu_initialized) return RGPU_PY;
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= rgpu_ndev || dev >= RGPU_MAX_DEV) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&rgpu_lock);
    *flags = rgpu_prims[dev].flags;
    *active = rgpu_prims[dev].retains > 0;
    pthread_mutex_unlock(&rgpu_lock);
    return CUDA_SUCCESS;
}

/* A capture begun on `stream` (the server accepted it): its id, 0 when the table is full. */
static uint64_t rgpu_capture_note(uint64_t stream, uint64_t graph) {
    uint64_t id = 0;
    pthread_mutex_lock(&rgpu_lock);
    if (rgpu_ncaps < RGPU_MAX_CAPTURES) {
        id = ++rgpu_capture_ids;
        rgpu_caps[rgpu_ncaps++] = (struct rgpu_capture){stream, id, graph};
    }
    pthread_mutex_unlock(&rgpu_lock);
    return id;
}

static void rgpu_capture_forget(uint64_t stream) {
    pthread_mutex_lock(&rgpu_lock);
    for (int i = 0; i < rgpu_ncaps; i++)
        if (rgpu_caps[i].stream == stream) { rgpu_caps[i] = rgpu_caps[--rgpu_ncaps]; break; }
    pthread_mutex_unlock(&rgpu_lock);
}

static int rgpu_capture_find(uint64_t stream, struct rgpu_capture *out) {
    int found = 0;
    pthread_mutex_lock(&rgpu_lock);
    for (int i = 0; i < rgpu_ncaps; i++)
        if (rgpu_caps[i].stream == stream) { *out = rgpu_caps[i]; found = 1; break; }
    pthread_mutex_unlock(&rgpu_lock);
    return found;
}

static CUresult rgpu_is_capturing(CUstream s, CUstreamCaptureStatus *status) {
    struct rgpu_capture c;
    if (!rgpu_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status = rgpu_capture_find((uint64_t)(uintptr_t)s, &c) ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                                             : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status) {
    return rgpu_is_capturing(s, status);
}

static CUresult rgpu_fast_cuStreamIsCapturing_ptsz(CUstream s, CUstreamCaptureStatus *status) {
    return rgpu_is_capturing(s ? s : RGPU_STREAM_PER_THREAD, status);
}

/* Status and id in C; a capture's dependency set lives on the server, so asking for it goes to Python (one
 * round trip, stream_get_capture_info), which fills the graph and the dependencies beside what C wrote. */
static CUresult rgpu_capture_info(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id, CUgraph *graph,
                                  const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps) {
    struct rgpu_capture c;
    if (!rgpu_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    if (!rgpu_capture_find((uint64_t)(uintptr_t)s, &c)) {
        *status = CU_STREAM_CAPTURE_STATUS_NONE;
        return CUDA_SUCCESS;
    }
    *status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    if (id) *id = c.id;
    if (deps || edges || ndeps || (graph && !c.graph)) return RGPU_PY;
    if (graph) *graph = (CUgraph)(uintptr_t)c.graph;
    return CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuStreamGetCaptureInfo_v3(CUstream s, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                                    const CUgraphNode **d, const CUgraphEdgeData **e, size_t *n) {
    return rgpu_capture_info(s, st, id, g, d, e, n);
}

static CUresult rgpu_fast_cuStreamGetCaptureInfo_v3_ptsz(CUstream s, CUstreamCaptureStatus *st, cuuint64_t *id,
                                                         CUgraph *g, const CUgraphNode **d, const CUgraphEdgeData **e,
                                                         size_t *n) {
    return rgpu_capture_info(s ? s : RGPU_STREAM_PER_THREAD, st, id, g, d, e, n);
}

static CUresult rgpu_fast_cuStreamGetCaptureInfo(CUstream s, CUstreamCaptureStatus *st, cuuint64_t *id) {
    return rgpu_capture_info(s, st, id, NULL, NULL, NULL, NULL);
}

static CUresult rgpu_fast_cuStreamGetCaptureInfo_ptsz(CUstream s, CUstreamCaptureStatus *st, cuuint64_t *id) {
    return rgpu_capture_info(s ? s : RGPU_STREAM_PER_THREAD, st, id, NULL, NULL, NULL, NULL);
}

/* The thread's capture mode: it only decides which calls a capture forbids, all of them on this side. */
static CUresult rgpu_fast_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode was = rgpu_capture_mode;
    rgpu_capture_mode = *mode;
    *mode = was;
    return CUDA_SUCCESS;
}

static CUresult rgpu_fast_cuStreamGetCaptureInfo_v2(CUstream s, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                                    const CUgraphNode **d, size_t *n) {
    return rgpu_capture_info(s, st, id, g, d, NULL, n);
}

static CUresult rgpu_fast_cuStreamGetCaptureInfo_v2_ptsz(CUstream s, CUstreamCaptureStatus *st, cuuint64_t *id,
                                                         CUgraph *g, const CUgraphNode **d, size_t *n) {
    return rgpu_capture_info(s ? s : RGPU_STREAM_PER_THREAD, st, id, g, d, NULL, n);
}
