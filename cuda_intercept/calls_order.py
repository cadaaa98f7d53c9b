"""Driver calls for order: streams, events, stream capture and graphs.

Event records, stream waits and graph launches are queued in C with the
launches (shim_queue.c; the functions here are the reference, RGPU_NATIVE=off,
and the fallback before a context); destroys are posted; synchronisations
wait and report any earlier posted failure.  Which streams are capturing is
known here (we forwarded the begin and the end) and noted in C
(shim_capture.c), which answers cuStreamIsCapturing and the status and id of
cuStreamGetCaptureInfo -- asked around many calls by runtimes -- with no
Python and no round trip.
"""
from __future__ import annotations

from . import client
from .calls_device import handle
from .registry import (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS,
                       CudaCallError, implements)

STREAM_CTX: dict[int, int] = {}


def h(x) -> int:
    return handle(client.get().ffi, x)


@implements("cuStreamCreate")
def cu_stream_create(ps, flags):
    return cu_stream_create_with_priority(ps, flags, 0)


@implements("cuStreamCreateWithPriority")
def cu_stream_create_with_priority(ps, flags, priority):
    c = client.get()
    s, _ = c.call("stream_create", int(flags), int(priority))
    STREAM_CTX[s] = c.ctx()
    ps[0] = c.ffi.cast("CUstream", s)
    return CUDA_SUCCESS


@implements("cuStreamDestroy", "cuStreamDestroy_v2")
def cu_stream_destroy(stream):
    s = h(stream)
    client.get().lib.rgpu_capture_forget(s)
    STREAM_CTX.pop(s, None)
    client.get().post("stream_destroy", s)
    return CUDA_SUCCESS


@implements("cuStreamSynchronize", "cuStreamSynchronize_ptsz", stream=0)
def cu_stream_synchronize(stream):
    c = client.get()
    c.call("stream_synchronize", h(stream), sync=True)
    c.idle(h(stream))
    return CUDA_SUCCESS


@implements("cuStreamQuery", "cuStreamQuery_ptsz", stream=0)
def cu_stream_query(stream):
    c = client.get()
    c.call("stream_query", h(stream), sync=True)     # not ready: raised, so no proof
    c.idle(h(stream))
    return CUDA_SUCCESS


@implements("cuStreamWaitEvent", "cuStreamWaitEvent_ptsz", stream=0)
def cu_stream_wait_event(stream, event, flags):
    client.get().post("stream_wait_event", h(stream), h(event), int(flags))
    return CUDA_SUCCESS


@implements("cuStreamGetFlags", "cuStreamGetFlags_ptsz", stream=0)
def cu_stream_get_flags(stream, pflags):
    pflags[0], _ = client.get().call("stream_get_flags", h(stream))
    return CUDA_SUCCESS


@implements("cuStreamGetPriority", "cuStreamGetPriority_ptsz", stream=0)
def cu_stream_get_priority(stream, pprio):
    pprio[0], _ = client.get().call("stream_get_priority", h(stream))
    return CUDA_SUCCESS


@implements("cuStreamGetCtx", "cuStreamGetCtx_ptsz", stream=0)
def cu_stream_get_ctx(stream, pctx):
    c = client.get()
    pctx[0] = c.ffi.cast("CUcontext", STREAM_CTX.get(h(stream), c.ctx()))
    return CUDA_SUCCESS


# ---- events ------------------------------------------------------------------------------
@implements("cuEventCreate")
def cu_event_create(pe, flags):
    c = client.get()
    e, _ = c.call("event_create", int(flags))
    pe[0] = c.ffi.cast("CUevent", e)
    return CUDA_SUCCESS


@implements("cuEventDestroy", "cuEventDestroy_v2")
def cu_event_destroy(event):
    client.get().post("event_destroy", h(event))
    return CUDA_SUCCESS


@implements("cuEventRecord", "cuEventRecord_ptsz", stream=1)
def cu_event_record(event, stream):
    client.get().post("event_record", h(event), h(stream), 0)
    return CUDA_SUCCESS


@implements("cuEventRecordWithFlags", "cuEventRecordWithFlags_ptsz", stream=1)
def cu_event_record_with_flags(event, stream, flags):
    client.get().post("event_record", h(event), h(stream), int(flags))
    return CUDA_SUCCESS


@implements("cuEventSynchronize")
def cu_event_synchronize(event):
    client.get().call("event_synchronize", h(event), sync=True)
    return CUDA_SUCCESS


@implements("cuEventQuery")
def cu_event_query(event):
    client.get().call("event_query", h(event), sync=True)
    return CUDA_SUCCESS


@implements("cuEventElapsedTime", "cuEventElapsedTime_v2")
def cu_event_elapsed_time(pms, start, end):
    pms[0], _ = client.get().call("event_elapsed_time", h(start), h(end))
    return CUDA_SUCCESS


# ---- capture and graphs: one round trip per replayed step ---------------------------------
@implements("cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz", stream=0)
def cu_stream_begin_capture(stream, mode):
    c = client.get()
    s = h(stream)
    graph, _ = c.call("stream_begin_capture", s, int(mode))
    if not c.lib.rgpu_capture_note(s, graph if isinstance(graph, int) else 0):
        c.call("stream_end_capture", s, sync=True)
        raise CudaCallError(CUDA_ERROR_NOT_SUPPORTED, "cuStreamBeginCapture: more than 256 captures at once")
    return CUDA_SUCCESS


@implements("cuStreamEndCapture", "cuStreamEndCapture_ptsz", stream=0)
def cu_stream_end_capture(stream, pgraph):
    c = client.get()
    s = h(stream)
    c.lib.rgpu_capture_forget(s)
    g, _ = c.call("stream_end_capture", s, sync=True)
    pgraph[0] = c.ffi.cast("CUgraph", g)
    return CUDA_SUCCESS


@implements("cuStreamIsCapturing", "cuStreamIsCapturing_ptsz", stream=0)
def cu_stream_is_capturing(stream, pstatus):
    return CUDA_ERROR_NOT_INITIALIZED     # C answers after cuInit


@implements("cuStreamGetCaptureInfo", "cuStreamGetCaptureInfo_ptsz", "cuStreamGetCaptureInfo_v2",
            "cuStreamGetCaptureInfo_v2_ptsz", "cuStreamGetCaptureInfo_v3", "cuStreamGetCaptureInfo_v3_ptsz", stream=0)
def cu_stream_get_capture_info(stream, *outs):
    """C wrote the status and id (after cuInit); the graph and the dependency set are the server's: one call.

    outs: v1 (status, id); v2 (status, id, graph, deps, count); v3 (status, id, graph, deps, edges, count).
    The arrays stay valid until the next such question about the stream, as the driver's do.
    """
    c = client.get()
    if c.init_info is None:
        return CUDA_ERROR_NOT_INITIALIZED
    if len(outs) < 5:
        return CUDA_SUCCESS                  # v1: nothing C did not answer
    ffi, s = c.ffi, h(stream)
    graph_out, deps_out, count_out = outs[2], outs[3], outs[-1]
    edges_out = outs[4] if len(outs) == 6 else ffi.NULL
    (_, _, graph, deps), _ = c.call("stream_get_capture_info", s)
    nodes = ffi.new("CUgraphNode[]", max(1, len(deps)))
    for i, n in enumerate(deps):
        nodes[i] = ffi.cast("CUgraphNode", n)
    edges = ffi.new("CUgraphEdgeData[]", max(1, len(deps)))     # all default edges: rgpu captures no edge data
    c.keep.setdefault("capture_deps", {})[s] = (nodes, edges)
    if graph_out != ffi.NULL:
        graph_out[0] = ffi.cast("CUgraph", graph)
    if deps_out != ffi.NULL:
        deps_out[0] = nodes
    if edges_out != ffi.NULL:
        edges_out[0] = edges
    if count_out != ffi.NULL:
        count_out[0] = len(deps)
    return CUDA_SUCCESS


@implements("cuGraphGetNodes")
def cu_graph_get_nodes(graph, nodes, pcount):
    """nodes NULL: *pcount is the graph's node count; else up to *pcount handles, and *pcount the number written."""
    c = client.get()
    if pcount == c.ffi.NULL:
        return CUDA_ERROR_INVALID_VALUE
    try:
        found, _ = c.call("graph_get_nodes", h(graph))
    except CudaCallError as exc:             # name the graph: a handle the server does not know is the usual cause
        raise CudaCallError(exc.code, f"cuGraphGetNodes(graph {h(graph):#x}, nodes "
                                      f"{'NULL' if nodes == c.ffi.NULL else 'given'}, *count {int(pcount[0])}): {exc}")
    if nodes == c.ffi.NULL:
        pcount[0] = len(found)
        return CUDA_SUCCESS
    n = min(int(pcount[0]), len(found))
    for i in range(n):
        nodes[i] = c.ffi.cast("CUgraphNode", found[i])
    pcount[0] = n
    return CUDA_SUCCESS


@implements("cuGraphInstantiateWithFlags")
def cu_graph_instantiate_with_flags(pexec, graph, flags):
    c = client.get()
    e, _ = c.call("graph_instantiate", h(graph), int(flags))
    pexec[0] = c.ffi.cast("CUgraphExec", e)
    return CUDA_SUCCESS


@implements("cuGraphInstantiate", "cuGraphInstantiate_v2")
def cu_graph_instantiate(pexec, graph, perror_node, log, log_size):
    c = client.get()
    if perror_node != c.ffi.NULL:
        perror_node[0] = c.ffi.NULL
    if log != c.ffi.NULL and log_size:
        log[0] = b"\0"
    return cu_graph_instantiate_with_flags(pexec, graph, 0)


@implements("cuGraphLaunch", "cuGraphLaunch_ptsz", stream=1)
def cu_graph_launch(exec_, stream):
    client.get().post("graph_launch", h(exec_), h(stream))
    return CUDA_SUCCESS


@implements("cuGraphUpload", "cuGraphUpload_ptsz", stream=1)
def cu_graph_upload(exec_, stream):
    client.get().post("graph_upload", h(exec_), h(stream))
    return CUDA_SUCCESS


@implements("cuGraphExecDestroy")
def cu_graph_exec_destroy(exec_):
    client.get().post("graph_exec_destroy", h(exec_))
    return CUDA_SUCCESS


@implements("cuGraphDestroy")
def cu_graph_destroy(graph):
    if not graph:
        raise CudaCallError(CUDA_ERROR_INVALID_VALUE)
    client.get().post("graph_destroy", h(graph))
    return CUDA_SUCCESS


@implements("cuStreamGetId", "cuStreamGetId_ptsz", stream=0)
def cu_stream_get_id(stream, pid):
    pid[0] = h(stream)                   # unique while the stream lives, as the driver's ids are
    return CUDA_SUCCESS


@implements("cuStreamGetCtx_v2", "cuStreamGetCtx_v2_ptsz", stream=0)
def cu_stream_get_ctx_v2(stream, pctx, pgreen):
    c = client.get()
    pctx[0] = c.ffi.cast("CUcontext", STREAM_CTX.get(h(stream), c.ctx()))
    if pgreen != c.ffi.NULL:
        pgreen[0] = c.ffi.NULL
    return CUDA_SUCCESS


@implements("cuStreamGetDevice", "cuStreamGetDevice_ptsz", stream=0)
def cu_stream_get_device(stream, pdev):
    c = client.get()
    dev = c.lib.rgpu_ctx_device(STREAM_CTX.get(h(stream), c.ctx()))
    if dev < 0:
        raise CudaCallError(201)
    pdev[0] = dev
    return CUDA_SUCCESS
