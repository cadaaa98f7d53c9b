"""The real CUDA driver behind the cuda route (a GPU host): FakeDriver's contract, on libcuda.so.1 through ctypes.

Handles are the driver's own pointer values.  The worker thread's current
context is set per call by the executor; calls that would change it as a side
effect (context creation) put it back, so the executor's idea of it stays true.
"""
from __future__ import annotations

import ctypes
import threading
from ctypes import byref, c_int, c_size_t, c_uint, c_ulonglong, c_void_p

import numpy as np

from .base import (CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_INFO_LOG_BUFFER,
                   CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, CUDA_ERROR_INVALID_VALUE, CudaDriverError, Driver)
from .real_api import Api, load
from .real_code import RealCode

LOG_BYTES = 16 << 10
POOL_INT_ATTRS = {1, 2, 3}     # CU_MEMPOOL_ATTR_REUSE_*: int; the others are cuuint64_t
_INT32_MIN = -(1 << 31)


def address(buf) -> int:
    """The address of a buffer's bytes, read-only buffers included, without a copy."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0


class JitOptions:
    """cuJIT options as the driver takes them, with log buffers the driver writes into."""

    def __init__(self, options: dict | None):
        self.info = ctypes.create_string_buffer(LOG_BYTES)
        self.error = ctypes.create_string_buffer(LOG_BYTES)
        opts = {int(k): int(v) for k, v in (options or {}).items()
                if int(k) not in (CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                                  CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)}
        opts.update({CU_JIT_INFO_LOG_BUFFER: ctypes.addressof(self.info), CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES: LOG_BYTES,
                     CU_JIT_ERROR_LOG_BUFFER: ctypes.addressof(self.error), CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: LOG_BYTES})
        self.n = len(opts)
        self.keys = (c_int * self.n)(*opts.keys())
        self.values = (c_void_p * self.n)(*opts.values())

    def logs(self) -> list[str]:
        return [self.info.value.decode(errors="replace"), self.error.value.decode(errors="replace")]


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
        self.code = RealCode(self)

    def __getattr__(self, name):
        code = self.__dict__.get("code")
        if code is not None and hasattr(code, name):
            return getattr(code, name)
        raise AttributeError(name)

    def _out(self, name: str, ctype, *args):
        v = ctype()
        self.api(name, byref(v), *args)
        return v.value

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

    def close(self) -> None:
        for ctx in list(self.created):
            self.api.lib.cuCtxDestroy_v2(ctx)
        for dev, n in self.retained.items():
            for _ in range(n):
                self.api.lib.cuDevicePrimaryCtxRelease_v2(dev)
