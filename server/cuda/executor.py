"""The ``cuda`` route: runs the CUDA driver calls a client's libcuda.so.1 forwards, on the real driver or the fake one.

Wire format (msgpack meta, raw buffers):

    request  [op, ctx, *args] + buffers   op: a driver method (see OPS), ctx: the caller's current context
    reply    [code, value, deferred]      code: CUresult; deferred: [[op, code, message], ...] of posts that
                                          failed since the last reply (their errors surface at the next sync)
    post     [op, ctx, *args]             same ops, no reply
    post     ["launches", 0]  + [records] the interceptor's C queue: launches (LAUNCH) and, in the same order, its
                                          memsets, event records, waits, frees, small copies, graph launches
                                          (OP, cuda/records.py)
    request  ["image_load", ctx, "module" | "library" | "library_kernels", options, sha256, size] [+ the bytes]
                              content-addressed loading: with no bytes, a known image loads from the
                              server's store and an unknown one answers value {"send": true}, after which
                              the client repeats the request with the bytes (images.py); "library_kernels"
                              answers [library, {name: [kernel, layout]} or None]: each kernel's look-up
                              is then the client's
    request  ["lib_call", ctx, call, handle, stream] [+ payload]   a math library's call (cuBLAS, cuBLASLt,
                              cuDNN: rgpu.protocol.cuda_libs, run by libs/), answered: value [status, message]
                              (+ the call's output as the buffer); queued ones come in the launch records

Buffers travel after the meta args (a copy's bytes, a module image). A value
that is bytes (a device-to-host copy, a linked image) comes back as the reply's
buffer, the rest of it in ``value``.
"""
from __future__ import annotations

import logging
import sys
import time
from collections import Counter

import numpy as np

from rgpu.protocol.cuda import ATTR_BYTES, LAUNCH, LAUNCH_EX_ATTRS, LAUNCH_EX_KIND, LAUNCH_KIND, RECORD_HEAD
from rgpu.server.cuda import open_driver, records as queued
from rgpu.server.cuda.base import (
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN, CudaDriverError,
)
from rgpu.server.cuda.images import ImageStore, digest_of, valid_digest
from rgpu.server.cuda.libs import Libraries

from rgpu.server import quotas
from rgpu.server.route import Executor as BaseExecutor, OpFailed

log = logging.getLogger("rgpu.server.cuda")

# The driver methods a client may call; nothing else is reachable by name.
OPS = frozenset("""
init primary_ctx_retain primary_ctx_release primary_ctx_reset primary_ctx_get_state primary_ctx_set_flags
ctx_create ctx_destroy ctx_synchronize ctx_get_flags ctx_get_limit ctx_set_limit ctx_get_stream_priority_range
ctx_set_cache_config
mem_alloc mem_free mem_get_info mem_get_address_range memcpy_htod memcpy_dtoh memcpy_dtod memset
module_load module_unload module_get_function module_get_global param_layout func_name func_get_attribute
func_set_attribute func_set_cache_config library_load library_unload library_get_module library_get_kernel
kernel_get_function library_get_global link_create link_add_data link_complete link_destroy launch
occupancy_max_active_blocks occupancy_max_potential_block_size
stream_create stream_destroy stream_synchronize stream_query stream_get_flags stream_get_priority stream_wait_event
event_create event_destroy event_record event_synchronize event_query event_elapsed_time
stream_begin_capture stream_end_capture stream_is_capturing graph_instantiate graph_launch graph_upload
graph_exec_destroy graph_destroy graph_get_nodes stream_get_capture_info kernel_get_attribute kernel_set_attribute
mem_alloc_async mem_free_async device_get_default_mem_pool mem_pool_set_attribute mem_pool_get_attribute mem_pool_trim_to
library_get_kernel_layout module_get_function_layout func_get_attributes kernel_get_attributes
lib_call lib_record
""".split())

# Launch records from the interceptor's C queue (shim_launch.c): their layout is rgpu.protocol.cuda's.
# func may be a CUfunction or a CUkernel (the driver launches either in the current context).
MAX_DEFERRED = 32


def image_folder():
    """``$XDG_CACHE_HOME/rgpu/server/images`` (read when a session starts)."""
    from rgpu.native import cache_root
    return cache_root() / "server" / "images"


class Executor(BaseExecutor):
    """One cuda-route session: the calls a client's ``libcuda.so.1`` forwards, run on one ``Driver``."""

    def __init__(self, session):
        """Open the driver ``RGPU_CUDA_DRIVER`` names (``open_driver``: ``ConfigError`` when ``real`` is asked
        for and unusable), the image store, the session's quota (``RGPU_MAX_SESSION_BYTES``) and the math
        libraries (loaded at their first call)."""
        super().__init__(session)
        settings = session.settings
        self.driver = open_driver(getattr(settings, "cuda_driver", "auto"), getattr(settings, "devices", 1))
        self.current = None
        self.deferred: list[list] = []
        self.images = ImageStore(image_folder(), settings.cuda_image_cache)
        self.held = quotas.CudaHeld(getattr(settings, "max_session_bytes", None))   # RGPU_MAX_SESSION_BYTES
        self.libs = Libraries(self.driver)       # cuBLAS, cuBLASLt, cuDNN: their handles and descriptors
        # RGPU_CUDA_WAIT_REPORT on the server: the session's answered calls by op, said when it ends (a C
        # program's client never finalizes its Python, so its own report at exit cannot be relied on)
        self.answered = Counter() if getattr(settings, "cuda_wait_report", False) else None
        # with the same report: the queued records this session ran in Python (by call, the walker's rest) and
        # the seconds spent on batches of records, which say whether the server sets a step's pace
        self.slow = Counter() if self.answered is not None else None
        self.batch_s = 0.0

    def welcome(self) -> dict:
        """``{"route": "cuda", "driver": "real" | "fake"}`` for the client's WELCOME."""
        return {"route": "cuda", "driver": self.driver.name}

    def _enter(self, ctx: int) -> None:
        if ctx != self.current:
            self.driver.set_current(ctx)
            self.current = ctx

    def _run(self, op: str, ctx: int, args, buffers):
        if op not in OPS and op != "image_load":
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, f"unknown cuda route op {op!r}")
        self._enter(ctx)
        if op == "image_load":
            return self._image_load(*args, *buffers)
        if op in ("lib_call", "lib_record"):      # a math library's call: answered, or from the queue
            return self.libs.run(*args, *buffers, answered=op == "lib_call")
        if op in ("ctx_destroy", "primary_ctx_release", "primary_ctx_reset"):
            self.current = None     # the driver may have popped or dropped the current context
        try:
            self.held.before(op, args)
        except quotas.QuotaExceeded as exc:   # what the driver says when memory runs out, with the quota named
            raise CudaDriverError(CUDA_ERROR_OUT_OF_MEMORY, str(exc), op=op) from None
        value = getattr(self.driver, op)(*args, *buffers)
        self.held.after(op, ctx, args, value)
        return value

    def handle(self, meta, buffers, reply):
        """Run ``[op, ctx, *args]`` (an ``OPS`` name, ``image_load``, ``lib_call``/``lib_record``, or
        ``launches`` with the C queue's records as ``buffers[0]``) in context ``ctx``.

        A request (``reply``) answers ``[code, value, deferred], buffers``: ``code`` 0 and the call's value
        (bytes as the reply's buffer), or the CUresult and message of its ``CudaDriverError`` (INVALID_VALUE
        for wrong arguments, UNKNOWN for anything else, logged), and ``deferred``, the ``[op, code,
        message]`` of posts that failed since the last reply (at most ``MAX_DEFERRED``). A post returns None;
        its failure waits in ``deferred``. Raises ``OpFailed`` only for a message that is not ``[op, ctx,
        ...]`` (an ERROR frame)."""
        if not isinstance(meta, list) or len(meta) < 2 or not isinstance(meta[0], str):
            raise OpFailed("cuda", "malformed cuda route message: expected [op, ctx, *args]")
        op, ctx, args = meta[0], meta[1], meta[2:]
        if not reply:
            try:
                if op == "launches":
                    if self.slow is None:
                        self._launches(buffers[0])
                    else:
                        self._timed_launches(buffers[0])
                else:
                    self._run(op, ctx, args, buffers)
            except Exception as exc:       # remembered, reported at the next reply
                self._defer(op, exc)
            return None
        deferred, self.deferred = self.deferred, []
        if self.answered is not None:
            self.answered[op] += 1
        try:
            value = self._run(op, ctx, args, buffers)
        except Exception as exc:
            code, message = self._code(op, exc)
            return [code, message, deferred], []
        # reply buffers go to the transport as memoryviews (it sends them without a copy)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return [0, None, deferred], [memoryview(value)]
        if isinstance(value, list) and value and isinstance(value[0], (bytes, bytearray, memoryview)):
            return [0, value[1:], deferred], [memoryview(value[0])]
        return [0, value, deferred], []

    def _image_load(self, what: str, options, digest: str, size: int, data=None):
        """Load a module or library by its sha256: from the store, else from ``data`` (checked against it)."""
        load = {"module": self.driver.module_load, "library": self.driver.library_load,
                "library_kernels": self._library_with_kernels}.get(what)
        if load is None or not valid_digest(digest) or not isinstance(size, int) or size < 0:
            raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, "image_load: expected module|library|library_kernels, "
                                                            "a sha256, a size")
        if data is None:
            image = self.images.get(digest)
            if image is None:
                return {"send": True}
        else:
            if data.nbytes != size or digest_of(data) != digest:
                raise CudaDriverError(CUDA_ERROR_INVALID_VALUE, f"image_load: the {data.nbytes} bytes sent do not "
                                                                f"match sha256 {digest[:12]}... of {size} bytes")
            image = self.images.put(digest, data)
        return load(options, image)

    def _library_with_kernels(self, options, image) -> list:
        """``[library, {name: [kernel, layout]} or None]``: the client then finds a kernel without a round trip."""
        lib = self.driver.library_load(options, image)
        return [lib, self.driver.library_kernels(lib)]

    def _code(self, op: str, exc: Exception) -> tuple[int, str]:
        if isinstance(exc, CudaDriverError):
            return exc.code, str(exc)
        if isinstance(exc, TypeError):       # wrong argument count or types from the client
            return CUDA_ERROR_INVALID_VALUE, f"{op}: {exc}"
        log.exception("cuda route op %s failed", op)
        return CUDA_ERROR_UNKNOWN, f"{op}: {type(exc).__name__}: {exc}"

    def _defer(self, op: str, exc: Exception) -> None:
        code, message = self._code(op, exc)
        if len(self.deferred) < MAX_DEFERRED:
            self.deferred.append([op, code, message])

    def _launches(self, records: memoryview, batch: bool = True) -> None:
        """Run a batch of queued records in order; a failing one is deferred and the rest still run, as on a GPU."""
        pos, end = 0, records.nbytes
        batch = self.driver.launch_records if batch else None       # None where the driver has no walker
        cublas = self.libs.records_table() if batch else None
        # where the records lie, found once (it costs more than a walk of a few records); the real driver
        # walks them there, and launches each record's packed arguments there (no slicing, no copy)
        launch_at = self.driver.launch_at
        base = np.frombuffer(records, dtype=np.uint8).ctypes.data if (batch or launch_at) and end else 0
        while batch is not None and pos + RECORD_HEAD.size <= end:
            done = batch(base, end, pos, self.current, cublas)   # the real driver walks the records in C
            if done is None:
                break
            pos, ctx, rc = done
            self.current = ctx if ctx != (1 << 64) - 1 else self.current
            if rc == 0:
                return
            if rc == -1:
                raise OpFailed("launches", f"malformed launch record at byte {pos}")
            if RECORD_HEAD.unpack_from(records, pos)[1] in queued.KINDS:   # a kind the walker leaves here
                pos = self._queued_one(records, pos, end)
            else:
                pos = self._launch_one(records, pos)      # the one that failed: retried and explained here
        launch = self.driver.launch
        while pos + RECORD_HEAD.size <= end:
            if RECORD_HEAD.unpack_from(records, pos)[1] in queued.KINDS:
                pos = self._queued_one(records, pos, end)
                continue
            if pos + LAUNCH.size > end:
                raise OpFailed("launches", f"malformed launch record at byte {pos}")
            size, kind, func, ctx, stream, gx, gy, gz, bx, by, bz, shared, nargs = LAUNCH.unpack_from(records, pos)
            if size < LAUNCH.size + nargs or pos + size > end or kind not in (LAUNCH_KIND, LAUNCH_EX_KIND):
                raise OpFailed("launches", f"malformed launch record at byte {pos}")
            if self.slow is not None:
                self.slow["cuLaunchKernelEx" if kind == LAUNCH_EX_KIND else "cuLaunchKernel"] += 1
            try:
                if ctx != self.current:
                    self._enter(ctx)
                if kind == LAUNCH_EX_KIND:
                    attrs, args = self._ex_parts(records, pos, size, nargs)
                    launch(func, (gx, gy, gz), (bx, by, bz), shared, stream, attrs, args)
                elif launch_at:
                    launch_at(func, gx, gy, gz, bx, by, bz, shared, stream, base + pos + LAUNCH.size, nargs)
                else:
                    launch(func, (gx, gy, gz), (bx, by, bz), shared, stream, None,
                           records[pos + LAUNCH.size:pos + LAUNCH.size + nargs])
            except Exception as exc:
                self._defer("cuLaunchKernel", exc)
            pos += size

    def _timed_launches(self, records: memoryview) -> None:
        start = time.perf_counter()
        try:
            self._launches(records)
        finally:
            self.batch_s += time.perf_counter() - start
            self.slow["batches"] += 1

    @staticmethod
    def _ex_parts(records: memoryview, pos: int, size: int, nargs: int):
        """A cuLaunchKernelEx record's attributes (72-byte structs, or None) and packed arguments."""
        at = pos + LAUNCH.size
        if size < LAUNCH.size + LAUNCH_EX_ATTRS.size + nargs:
            raise OpFailed("launches", f"malformed cuLaunchKernelEx record at byte {pos}")
        nattrs, _ = LAUNCH_EX_ATTRS.unpack_from(records, at)
        at += LAUNCH_EX_ATTRS.size
        if size < at - pos + nattrs * ATTR_BYTES + nargs:
            raise OpFailed("launches", f"cuLaunchKernelEx record at byte {pos}: {nattrs} attributes do not fit")
        attrs = [bytes(records[at + i * ATTR_BYTES:at + (i + 1) * ATTR_BYTES]) for i in range(nattrs)] or None
        at += nattrs * ATTR_BYTES
        return attrs, records[at:at + nargs]

    def _queued_one(self, records: memoryview, pos: int, end: int) -> int:
        """Run a memset, event record, wait, free, copy or graph launch record as its posted op would run."""
        got = queued.decode(records, pos, end)
        if got is None:
            raise OpFailed("launches", f"malformed queued record (kind {RECORD_HEAD.unpack_from(records, pos)[1]}) "
                                       f"at byte {pos}")
        size, ctx, op, args, buffers = got
        if self.slow is not None:
            self.slow[self.libs.call_name(args[0]) if op == "lib_record" else op] += 1
        try:
            self._run(op, ctx, args, buffers)
        except Exception as exc:
            self._defer(op, exc)
        return pos + size

    def _launch_one(self, records: memoryview, pos: int) -> int:
        """Run the record at ``pos`` on the per-record path; returns where the next one starts."""
        size = RECORD_HEAD.unpack_from(records, pos)[0]
        if size < RECORD_HEAD.size or pos + size > records.nbytes:
            raise OpFailed("launches", f"malformed record at byte {pos}")
        self._launches(records[pos:pos + size], batch=False)
        return pos + size

    def close(self) -> None:
        """Release the math libraries' handles, then every context and allocation the driver made (failures
        logged: the worker exits next); with ``RGPU_CUDA_WAIT_REPORT`` say the answered calls on stderr."""
        if self.answered is not None:
            top = ", ".join(f"{op} {n}" for op, n in self.answered.most_common(12))
            print(f"rgpu worker: a cuda session answered {sum(self.answered.values())} calls (round trips); the "
                  f"most: {top}", file=sys.stderr, flush=True)
            batches = self.slow.pop("batches", 0)
            slow = ", ".join(f"{op} {n}" for op, n in self.slow.most_common(12)) or "none"
            print(f"rgpu worker: {batches} batches of queued records took {self.batch_s * 1e3:.3f} ms on the server; "
                  f"{sum(self.slow.values())} records ran in Python, the most: {slow}", file=sys.stderr, flush=True)
        try:
            self.libs.close()                # every handle and descriptor, before the contexts go
        except Exception:
            log.exception("closing the math libraries failed")
        try:
            self.driver.close()
        except Exception:                    # the worker exits next; the OS reclaims the rest
            log.exception("closing the cuda driver failed")
