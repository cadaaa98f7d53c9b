/* rgpu's libcudart.so.13: order.  Streams, events, stream capture, graphs, and the refusals of what cannot cross.
 *
 * Event records, stream waits, destroys and graph launches are queued by
 * libcuda.so.1; synchronisations and queries wait, and report a failure of an
 * earlier queued call (rt_cu_sync).  Whether a stream is capturing is answered
 * in C by the driver, which torch asks around many calls.
 */
#include "cudart_internal.h"

#define S(s, pt) rt_stream((s), (pt))
/* Each body once, then the legacy export and its per-thread-default-stream twin. */
#define TWIN(name, params, args)                                                  \
    RT_API cudaError_t name params { return name##_(args, 0); }                   \
    RT_API cudaError_t name##_ptsz params { return name##_(args, 1); }

static cudaError_t refuse(const char *what, const char *why) {
    fprintf(stderr, "rgpu: %s is not supported over rgpu: %s\n", what, why);
    return rt_ret(cudaErrorNotSupported);
}

/* ---- streams ----------------------------------------------------------------------------- */
RT_API cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned int flags, int priority) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuStreamCreateWithPriority((CUstream *)s, flags, priority));
}

RT_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
    return cudaStreamCreateWithPriority(s, flags, 0);
}

RT_API cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithPriority(s, cudaStreamDefault, 0); }

RT_API cudaError_t cudaStreamDestroy(cudaStream_t s) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuStreamDestroy((CUstream)s));
}

static cudaError_t cudaStreamSynchronize_(cudaStream_t s, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu_sync(cuStreamSynchronize(S(s, pt)));
}
TWIN(cudaStreamSynchronize, (cudaStream_t s), s)

/* Not ready is an answer, never the thread's last error. */
static cudaError_t query(CUresult r) {
    return r == CUDA_ERROR_NOT_READY ? cudaErrorNotReady : rt_cu_sync(r);
}

static cudaError_t cudaStreamQuery_(cudaStream_t s, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : query(cuStreamQuery(S(s, pt)));
}
TWIN(cudaStreamQuery, (cudaStream_t s), s)

struct wait_args { cudaStream_t s; cudaEvent_t ev; unsigned int flags; };
static cudaError_t wait_(struct wait_args a, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuStreamWaitEvent(S(a.s, pt), (CUevent)a.ev, a.flags));
}
RT_API cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned int flags) {
    return wait_((struct wait_args){s, ev, flags}, 0);
}
RT_API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t s, cudaEvent_t ev, unsigned int flags) {
    return wait_((struct wait_args){s, ev, flags}, 1);
}

#define GETTER(name, type, call)                                                       \
    static cudaError_t name##_(cudaStream_t s, type *out, int pt) {                    \
        cudaError_t e = rt_ctx();                                                      \
        return e ? e : rt_cu(call(S(s, pt), out));                                     \
    }                                                                                  \
    RT_API cudaError_t name(cudaStream_t s, type *out) { return name##_(s, out, 0); }  \
    RT_API cudaError_t name##_ptsz(cudaStream_t s, type *out) { return name##_(s, out, 1); }

GETTER(cudaStreamGetPriority, int, cuStreamGetPriority)
GETTER(cudaStreamGetFlags, unsigned int, cuStreamGetFlags)
GETTER(cudaStreamGetId, unsigned long long, cuStreamGetId)
GETTER(cudaStreamGetDevice, int, cuStreamGetDevice)

/* ---- events ------------------------------------------------------------------------------ */
RT_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned int flags) {
    if (flags & cudaEventInterprocess) return refuse("cudaEventInterprocess", "IPC handles name events on the server's host");
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuEventCreate((CUevent *)ev, flags));   /* the runtime's flags are the driver's */
}

RT_API cudaError_t cudaEventCreate(cudaEvent_t *ev) { return cudaEventCreateWithFlags(ev, cudaEventDefault); }

RT_API cudaError_t cudaEventDestroy(cudaEvent_t ev) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuEventDestroy((CUevent)ev));
}

static cudaError_t record(cudaEvent_t ev, cudaStream_t s, unsigned int flags, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuEventRecordWithFlags((CUevent)ev, S(s, pt), flags));
}

RT_API cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s) { return record(ev, s, 0, 0); }
RT_API cudaError_t cudaEventRecord_ptsz(cudaEvent_t ev, cudaStream_t s) { return record(ev, s, 0, 1); }
RT_API cudaError_t cudaEventRecordWithFlags(cudaEvent_t ev, cudaStream_t s, unsigned int flags) {
    return record(ev, s, flags, 0);
}
RT_API cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t ev, cudaStream_t s, unsigned int flags) {
    return record(ev, s, flags, 1);
}

RT_API cudaError_t cudaEventQuery(cudaEvent_t ev) {
    cudaError_t e = rt_ctx();
    return e ? e : query(cuEventQuery((CUevent)ev));
}

RT_API cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu_sync(cuEventSynchronize((CUevent)ev));
}

RT_API cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    cudaError_t e = rt_ctx();
    return e ? e : query(cuEventElapsedTime(ms, (CUevent)start, (CUevent)end));
}

/* ---- capture ----------------------------------------------------------------------------- */
static cudaError_t cudaStreamBeginCapture_(cudaStream_t s, enum cudaStreamCaptureMode mode, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuStreamBeginCapture_v2(S(s, pt), (CUstreamCaptureMode)mode));
}
RT_API cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    return cudaStreamBeginCapture_(s, mode, 0);
}
RT_API cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    return cudaStreamBeginCapture_(s, mode, 1);
}

static cudaError_t cudaStreamEndCapture_(cudaStream_t s, cudaGraph_t *g, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu_sync(cuStreamEndCapture(S(s, pt), (CUgraph *)g));
}
RT_API cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) { return cudaStreamEndCapture_(s, g, 0); }
RT_API cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t s, cudaGraph_t *g) { return cudaStreamEndCapture_(s, g, 1); }

static cudaError_t is_capturing(cudaStream_t s, enum cudaStreamCaptureStatus *st, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuStreamIsCapturing(S(s, pt), (CUstreamCaptureStatus *)st));
}
RT_API cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) { return is_capturing(s, st, 0); }
RT_API cudaError_t cudaStreamIsCapturing_ptsz(cudaStream_t s, enum cudaStreamCaptureStatus *st) {
    return is_capturing(s, st, 1);
}

/* CUDA 13's shape, with edge data: the driver's cuStreamGetCaptureInfo_v3. */
static cudaError_t capture_info(cudaStream_t s, enum cudaStreamCaptureStatus *st, unsigned long long *id,
                                cudaGraph_t *g, const cudaGraphNode_t **deps, const cudaGraphEdgeData **edges,
                                size_t *n, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuStreamGetCaptureInfo_v3(S(s, pt), (CUstreamCaptureStatus *)st, (cuuint64_t *)id, (CUgraph *)g,
                                                   (const CUgraphNode **)deps, (const CUgraphEdgeData **)edges, n));
}
RT_API cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus *st, unsigned long long *id,
                                            cudaGraph_t *g, const cudaGraphNode_t **deps,
                                            const cudaGraphEdgeData **edges, size_t *n) {
    return capture_info(s, st, id, g, deps, edges, n, 0);
}
RT_API cudaError_t cudaStreamGetCaptureInfo_ptsz(cudaStream_t s, enum cudaStreamCaptureStatus *st,
                                                 unsigned long long *id, cudaGraph_t *g,
                                                 const cudaGraphNode_t **deps, const cudaGraphEdgeData **edges,
                                                 size_t *n) {
    return capture_info(s, st, id, g, deps, edges, n, 1);
}

RT_API cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
    return rt_cu(cuThreadExchangeStreamCaptureMode((CUstreamCaptureMode *)mode));
}

/* ---- graphs ------------------------------------------------------------------------------ */
RT_API cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuGraphInstantiateWithFlags((CUgraphExec *)exec, (CUgraph)g, flags));
}

RT_API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags) {
    return cudaGraphInstantiateWithFlags(exec, g, flags);
}

static cudaError_t graph_launch(cudaGraphExec_t exec, cudaStream_t s, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuGraphLaunch((CUgraphExec)exec, S(s, pt)));
}
RT_API cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) { return graph_launch(exec, s, 0); }
RT_API cudaError_t cudaGraphLaunch_ptsz(cudaGraphExec_t exec, cudaStream_t s) { return graph_launch(exec, s, 1); }

static cudaError_t graph_upload(cudaGraphExec_t exec, cudaStream_t s, int pt) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuGraphUpload((CUgraphExec)exec, S(s, pt)));
}
RT_API cudaError_t cudaGraphUpload(cudaGraphExec_t exec, cudaStream_t s) { return graph_upload(exec, s, 0); }
RT_API cudaError_t cudaGraphUpload_ptsz(cudaGraphExec_t exec, cudaStream_t s) { return graph_upload(exec, s, 1); }

RT_API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuGraphExecDestroy((CUgraphExec)exec));
}

RT_API cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuGraphDestroy((CUgraph)g));
}

/* nodes NULL: *numNodes is set to the count; else up to *numNodes are written and *numNodes is the count written. */
RT_API cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *numNodes) {
    cudaError_t e = rt_ctx();
    return e ? e : rt_cu(cuGraphGetNodes((CUgraph)g, (CUgraphNode *)nodes, numNodes));
}

/* ---- refused: these cannot cross a network ----------------------------------------------- */
#define IPC "IPC handles name memory and events on the server's host"
RT_API cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) { (void)h; (void)p; return refuse("cudaIpcGetMemHandle", IPC); }
RT_API cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned int flags) {
    (void)p; (void)h; (void)flags;
    return refuse("cudaIpcOpenMemHandle", IPC);
}
RT_API cudaError_t cudaIpcCloseMemHandle(void *p) { (void)p; return refuse("cudaIpcCloseMemHandle", IPC); }
RT_API cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t *h, cudaEvent_t ev) {
    (void)h; (void)ev;
    return refuse("cudaIpcGetEventHandle", IPC);
}
RT_API cudaError_t cudaIpcOpenEventHandle(cudaEvent_t *ev, cudaIpcEventHandle_t h) {
    (void)ev; (void)h;
    return refuse("cudaIpcOpenEventHandle", IPC);
}

#define HOSTFN "host callbacks would run on the server, not in this process"
RT_API cudaError_t cudaStreamAddCallback(cudaStream_t s, cudaStreamCallback_t cb, void *data, unsigned int flags) {
    (void)s; (void)cb; (void)data; (void)flags;
    return refuse("cudaStreamAddCallback", HOSTFN);
}
RT_API cudaError_t cudaStreamAddCallback_ptsz(cudaStream_t s, cudaStreamCallback_t cb, void *data, unsigned int flags) {
    (void)s; (void)cb; (void)data; (void)flags;
    return refuse("cudaStreamAddCallback", HOSTFN);
}
RT_API cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *data) {
    (void)s; (void)fn; (void)data;
    return refuse("cudaLaunchHostFunc", HOSTFN);
}
RT_API cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t s, cudaHostFn_t fn, void *data) {
    (void)s; (void)fn; (void)data;
    return refuse("cudaLaunchHostFunc", HOSTFN);
}
