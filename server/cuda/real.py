"""The real CUDA driver behind the cuda route (a GPU host): ``base.Driver``'s contract on libcuda.so.1 through ctypes.

``RealDriver`` owns the devices, contexts, memory and ordering (streams, events, capture, graphs);
its ``code`` (``real_code.RealCode``) the modules, libraries, links and launches; both call the
driver through ``real_api.Api``.  Handles are the driver's own pointer values.  The worker thread's
current context is set per call by the executor; calls that would change it as a side effect
(context creation) put it back, so the executor's idea of it stays true.
"""
from __future__ import annotations

import ctypes
import threading
from ctypes import byref, c_float, c_int, c_size_t, c_uint, c_ulonglong, c_void_p

from .base import CUDA_ERROR_INVALID_VALUE, CudaDriverError, Driver
from .real_api import Api, address, load
from .real_code import RealCode

POOL_INT_ATTRS = {1, 2, 3}     # CU_MEMPOOL_ATTR_REUSE_*: int; the others are cuuint64_t
_INT32_MIN = -(1 << 31)


CU_STREAM_CAPTURE_MODE_RELAXED = 2   # cuda.h's CUstreamCaptureMode


class RealDriver(Driver):
    name = "real"

    def __init__(self):
        self.api = Api(load())
        self.api("cuInit", 0)
        n = c_int()
        self.api("cuDeviceGetCount", byref(n))
        if n.value < 1:
            raise CudaDriverError(100, "the driver sees no device")
        self.created: set[int] = set()
        self.retained: dict[int, int] = {}
        self._staging = bytearray()
        self._thread = threading.local()       # per worker thread: its capture mode made relaxed (set_current)
        self.code = RealCode(self.api)           # modules, libraries, links, launches
        self.launch_at = self.code.launch_at     # the executor's hot paths, the code's (base.Driver says what)
        self.launch_records = self.code.launch_records

    def _out(self, name: str, ctype, *args):
        return self.api.out(name, ctype, *args)

    # ---- devices and contexts --------------------------------------------------------
    def init(self, nattr: int) -> dict:
        api, out = self.api, []
        for dev in range(self._out("cuDeviceGetCount", c_int)):
            name = ctypes.create_string_buffer(256)
            api("cuDeviceGetName", name, 256, dev)
            bus = ctypes.create_string_buffer(64)
            api("cuDeviceGetPCIBusId", bus, 64, dev)
            uuid = ctypes.create_string_buffer(16)
            api("cuDeviceGetUuid_v2", uuid, dev)
            attrs, v = [], c_int()
            for a in range(nattr):
                attrs.append(v.value if self.api.lib.cuDeviceGetAttribute(byref(v), a, dev) == 0 else _INT32_MIN)
            out.append({"name": name.value.decode(), "total_mem": self._out("cuDeviceTotalMem_v2", c_size_t, dev),
                        "uuid": uuid.raw, "pci_bus_id": bus.value.decode(), "attrs": attrs})
        return {"driver": self.name, "version": self._out("cuDriverGetVersion", c_int), "devices": out}

    def primary_ctx_retain(self, dev: int) -> int:
        ctx = self._out("cuDevicePrimaryCtxRetain", c_void_p, dev)
        self.retained[dev] = self.retained.get(dev, 0) + 1
        return ctx

    def primary_ctx_release(self, dev: int) -> None:
        self.api("cuDevicePrimaryCtxRelease_v2", dev)
        self.retained[dev] = max(0, self.retained.get(dev, 0) - 1)

    def primary_ctx_reset(self, dev: int) -> None:
        self.api("cuDevicePrimaryCtxReset_v2", dev)

    def primary_ctx_get_state(self, dev: int) -> list:
        flags, active = c_uint(), c_int()
        self.api("cuDevicePrimaryCtxGetState", dev, byref(flags), byref(active))
        return [flags.value, active.value]

    def primary_ctx_set_flags(self, dev: int, flags: int) -> None:
        self.api("cuDevicePrimaryCtxSetFlags_v2", dev, flags)

    def ctx_create(self, dev: int, flags: int) -> int:
        ctx = self._out("cuCtxCreate_v2", c_void_p, flags, dev)
        self.api("cuCtxPopCurrent_v2", None)      # creation made it current; the executor decides that
        self.created.add(ctx)
        return ctx

    def ctx_destroy(self, ctx: int) -> None:
        self.api("cuCtxDestroy_v2", ctx)
        self.created.discard(ctx)

    def set_current(self, ctx: int) -> None:
        self.api("cuCtxSetCurrent", ctx or None)
        if not getattr(self._thread, "relaxed", False):
            # The calls of every client thread run on this one: in the driver's default (global) capture mode
            # one client thread's capture would refuse another's cudaMalloc, which torch's allocator makes in
            # relaxed mode while a graph is captured. The client's own mode is its business, on its side.
            mode = c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
            self.api("cuThreadExchangeStreamCaptureMode", byref(mode))
            self._thread.relaxed = True

    def ctx_synchronize(self) -> None:
        self.api("cuCtxSynchronize")

    def ctx_get_flags(self) -> int:
        return self._out("cuCtxGetFlags", c_uint)

    def ctx_get_limit(self, limit: int) -> int:
        return self._out("cuCtxGetLimit", c_size_t, limit)

    def ctx_set_limit(self, limit: int, value: int) -> None:
        self.api("cuCtxSetLimit", limit, value)

    def ctx_get_stream_priority_range(self) -> list:
        least, greatest = c_int(), c_int()
        self.api("cuCtxGetStreamPriorityRange", byref(least), byref(greatest))
        return [least.value, greatest.value]

    def ctx_set_cache_config(self, config: int) -> None:
        self.api("cuCtxSetCacheConfig", config)

    # ---- memory ----------------------------------------------------------------------
    def mem_alloc(self, size: int) -> int:
        return self._out("cuMemAlloc_v2", c_ulonglong, size)

    def mem_free(self, ptr: int) -> None:
        self.api("cuMemFree_v2", ptr)

    # stream-ordered allocation: the driver's own pools (a graph captures these as memory nodes)
    def mem_alloc_async(self, size: int, stream: int, pool: int | None = None) -> int:
        if pool is None:
            return self._out("cuMemAllocAsync", c_ulonglong, size, stream)
        return self._out("cuMemAllocFromPoolAsync", c_ulonglong, size, pool, stream)

    def mem_free_async(self, ptr: int, stream: int) -> None:
        self.api("cuMemFreeAsync", ptr, stream)

    def device_get_default_mem_pool(self, dev: int) -> int:
        return self._out("cuDeviceGetDefaultMemPool", c_void_p, dev)

    def mem_pool_set_attribute(self, pool: int, attr: int, value: int) -> None:
        v = c_int(value) if attr in POOL_INT_ATTRS else c_ulonglong(value)
        self.api("cuMemPoolSetAttribute", pool, attr, byref(v))

    def mem_pool_get_attribute(self, pool: int, attr: int) -> int:
        v = c_int() if attr in POOL_INT_ATTRS else c_ulonglong()
        self.api("cuMemPoolGetAttribute", pool, attr, byref(v))
        return v.value

    def mem_pool_trim_to(self, pool: int, keep: int) -> None:
        self.api("cuMemPoolTrimTo", pool, keep)

    def mem_get_info(self) -> list:
        free, total = c_size_t(), c_size_t()
        self.api("cuMemGetInfo_v2", byref(free), byref(total))
        return [free.value, total.value]

    def mem_get_address_range(self, ptr: int) -> list:
        base, size = c_ulonglong(), c_size_t()
        self.api("cuMemGetAddressRange_v2", byref(base), byref(size), ptr)
        return [base.value, size.value]

    def memcpy_htod(self, dst: int, stream: int | None, data) -> None:
        # a pageable source is staged before the call returns, so the frame's buffer may go right after
        if stream is None:
            self.api("cuMemcpyHtoD_v2", dst, address(data), len(data))
        else:
            self.api("cuMemcpyHtoDAsync_v2", dst, address(data), len(data), stream)

    def memcpy_dtoh(self, src: int, nbytes: int, stream: int | None):
        # into one buffer, reused (fresh memory costs page faults): the reply is written before the next call
        if len(self._staging) < nbytes:
            self._staging = bytearray(nbytes)
        view = memoryview(self._staging)[:nbytes]
        if stream is None:
            self.api("cuMemcpyDtoH_v2", address(view), src, nbytes)
        else:
            self.api("cuMemcpyDtoHAsync_v2", address(view), src, nbytes, stream)
            self.api("cuStreamSynchronize", stream)
        return view

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: int | None) -> None:
        if stream is None:
            self.api("cuMemcpyDtoD_v2", dst, src, nbytes)
        else:
            self.api("cuMemcpyDtoDAsync_v2", dst, src, nbytes, stream)

    def memset(self, dst: int, value: int, elem: int, count: int, stream: int | None) -> None:
        name = {1: "cuMemsetD8", 2: "cuMemsetD16", 4: "cuMemsetD32"}.get(elem)
        if name is None:
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, f"memset of {elem}-byte elements")
        if stream is None:
            self.api(name + "_v2", dst, value, count)
        else:
            self.api(name + "Async", dst, value, count, stream)

    # ---- streams, events, capture, graphs --------------------------------------------
    def stream_create(self, flags: int, priority: int) -> int:
        return self._out("cuStreamCreateWithPriority", c_void_p, flags, priority)

    def stream_destroy(self, stream: int) -> None:
        self.api("cuStreamDestroy_v2", stream)

    def stream_synchronize(self, stream: int) -> None:
        self.api("cuStreamSynchronize", stream)

    def stream_query(self, stream: int) -> None:
        self.api("cuStreamQuery", stream)

    def stream_get_flags(self, stream: int) -> int:
        v = c_uint()
        self.api("cuStreamGetFlags", stream, byref(v))
        return v.value

    def stream_get_priority(self, stream: int) -> int:
        v = c_int()
        self.api("cuStreamGetPriority", stream, byref(v))
        return v.value

    def stream_wait_event(self, stream: int, event: int, flags: int) -> None:
        self.api("cuStreamWaitEvent", stream, event, flags)

    def event_create(self, flags: int) -> int:
        return self._out("cuEventCreate", c_void_p, flags)

    def event_destroy(self, event: int) -> None:
        self.api("cuEventDestroy_v2", event)

    def event_record(self, event: int, stream: int, flags: int = 0) -> None:
        if flags:
            self.api("cuEventRecordWithFlags", event, stream, flags)
        else:
            self.api("cuEventRecord", event, stream)

    def event_synchronize(self, event: int) -> None:
        self.api("cuEventSynchronize", event)

    def event_query(self, event: int) -> None:
        self.api("cuEventQuery", event)

    def event_elapsed_time(self, start: int, end: int) -> float:
        v = c_float()
        name = "cuEventElapsedTime_v2" if self.api.has("cuEventElapsedTime_v2") else "cuEventElapsedTime"
        self.api(name, byref(v), start, end)
        return v.value

    def stream_begin_capture(self, stream: int, mode: int) -> None:
        self.api("cuStreamBeginCapture_v2", stream, mode)

    def stream_end_capture(self, stream: int) -> int:
        g = c_void_p()
        self.api("cuStreamEndCapture", stream, byref(g))
        return g.value

    def stream_is_capturing(self, stream: int) -> int:
        v = c_int()
        self.api("cuStreamIsCapturing", stream, byref(v))
        return v.value

    def stream_get_capture_info(self, stream: int) -> list:
        """[status, capture id, graph, [nodes the next captured work depends on]] (edge data stays here)."""
        status, cid, graph, deps, edges, n = c_int(), c_ulonglong(), c_void_p(), c_void_p(), c_void_p(), c_size_t()
        # edges asked for too: without them the driver refuses a lossy query when an edge carries data
        self.api("cuStreamGetCaptureInfo_v3", stream, byref(status), byref(cid), byref(graph), byref(deps),
                 byref(edges), byref(n))
        nodes = ctypes.cast(deps, ctypes.POINTER(c_void_p)) if deps.value else None
        return [status.value, cid.value, graph.value or 0, [nodes[i] or 0 for i in range(n.value)] if nodes else []]

    def graph_get_nodes(self, graph: int) -> list:
        n = c_size_t()
        self.api("cuGraphGetNodes", graph, None, byref(n))
        if not n.value:
            return []                        # an empty graph: no array to fill
        nodes = (c_void_p * n.value)()
        self.api("cuGraphGetNodes", graph, nodes, byref(n))
        return [nodes[i] or 0 for i in range(n.value)]

    def graph_instantiate(self, graph: int, flags: int) -> int:
        return self._out("cuGraphInstantiateWithFlags", c_void_p, graph, flags)

    def graph_launch(self, exec_: int, stream: int) -> None:
        self.api("cuGraphLaunch", exec_, stream)

    def graph_upload(self, exec_: int, stream: int) -> None:
        self.api("cuGraphUpload", exec_, stream)

    def graph_exec_destroy(self, exec_: int) -> None:
        self.api("cuGraphExecDestroy", exec_)

    def graph_destroy(self, graph: int) -> None:
        self.api("cuGraphDestroy", graph)

    def close(self) -> None:
        for ctx in list(self.created):
            self.api.lib.cuCtxDestroy_v2(ctx)
        for dev, n in self.retained.items():
            for _ in range(n):
                self.api.lib.cuDevicePrimaryCtxRelease_v2(dev)
