"""The real driver's batch launcher: ``launch_records.c`` walks the interceptor's queued records and runs each.

A ctypes call costs about as much as the launch itself (docs/perf/cuda_route-history.md),
so a batch of records goes to C in one call. cuBLAS's GEMM records in the same queue run there too, through
the session's table (``libs/cublas_records.c``, built into the same library; ``libs/cublas_real.py`` makes
and fills it). Built with the host's C compiler (``rgpu.native``) ahead by ``rgpu build`` or on first use,
and cached; where there is none, or ``RGPU_NATIVE=off``, the executor walks the records in Python instead
(``load()`` returns None, ``native.why_not(NAME)`` says why).
"""
from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p
from pathlib import Path

from rgpu import native, protocol

NAME = "launch_records"
HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "launch_records.c", *(HERE / "libs" / f"{lib}_records.c" for lib in ("cublas", "cublaslt", "cudnn"))]
_WALK = [c_void_p, c_void_p, c_void_p, c_size_t, POINTER(c_size_t), POINTER(c_uint64)]


class DriverOps(ctypes.Structure):
    """``struct rgpu_driver_ops``: the driver entry points a walk calls (NULL: that op's records are the
    executor's). Filled by ``driver_ops``."""
    _fields_ = [(name, c_void_p) for name in ("launch", "set_ctx", "event_record", "event_record_with_flags",
                                              "stream_wait_event", "graph_launch", "memcpy_htod", "memcpy_htod_async",
                                              "memcpy_dtod", "memcpy_dtod_async")]


# the field -> the driver's symbol: the same ones real.py calls for these ops through Python
DRIVER_SYMBOLS = {"launch": "cuLaunchKernel", "set_ctx": "cuCtxSetCurrent", "event_record": "cuEventRecord",
                  "event_record_with_flags": "cuEventRecordWithFlags", "stream_wait_event": "cuStreamWaitEvent",
                  "graph_launch": "cuGraphLaunch", "memcpy_htod": "cuMemcpyHtoD_v2",
                  "memcpy_htod_async": "cuMemcpyHtoDAsync_v2", "memcpy_dtod": "cuMemcpyDtoD_v2",
                  "memcpy_dtod_async": "cuMemcpyDtoDAsync_v2"}


def driver_ops(driver: ctypes.CDLL) -> DriverOps:
    """The entry points ``driver`` (the loaded libcuda) has; one it lacks stays NULL."""
    ops = DriverOps()
    for field, symbol in DRIVER_SYMBOLS.items():
        fn = getattr(driver, symbol, None)
        setattr(ops, field, ctypes.cast(fn, c_void_p).value if fn is not None else None)
    return ops


SIGNATURES = {   # name -> (argument types, result type)
    "rgpu_walk_all": ([POINTER(DriverOps), c_void_p, c_size_t, POINTER(c_size_t), POINTER(c_uint64), c_void_p],
                      c_int),
    "rgpu_walk_records": ([*_WALK, c_void_p], c_int),
    "rgpu_cublas_new": ([], c_void_p),
    "rgpu_cublas_free": ([c_void_p], None),
    "rgpu_cublas_bind": ([c_void_p, c_int, c_void_p], c_int),
    "rgpu_cublas_error": ([c_void_p], c_char_p),
    "rgpu_cublas_add": ([c_void_p, c_uint64, c_uint64], c_int),
    "rgpu_cublas_real": ([c_void_p, c_uint64, c_int], c_uint64),
    "rgpu_cublas_nth": ([c_void_p, c_size_t], c_uint64),
    "rgpu_cublas_use": ([c_void_p, c_uint64, c_uint64, c_char_p, c_size_t, POINTER(c_uint64)], c_int),
    "rgpu_cublas_runs": ([c_void_p, c_uint32], c_int),
    "rgpu_cublas_record": ([c_void_p, c_uint32, c_uint64, c_uint64, c_void_p, c_size_t], c_int),
    "rgpu_cublas_set_lt": ([c_void_p, c_void_p], None),
    "rgpu_cublaslt_new": ([c_void_p, c_void_p], c_void_p),
    "rgpu_cublaslt_free": ([c_void_p], None),
    "rgpu_cublaslt_forget": ([c_void_p], None),
    "rgpu_cublaslt_states": ([c_void_p], c_size_t),
    "rgpu_cublaslt_state": ([c_void_p, c_char_p, c_size_t, POINTER(c_uint64), c_int32, c_size_t, POINTER(c_int32),
                             POINTER(c_uint64)], c_int),
    "rgpu_cublaslt_pointers": ([c_void_p, c_uint64, c_size_t, POINTER(c_int32), POINTER(c_uint64)], c_int),
    "rgpu_cublaslt_record": ([c_void_p, c_void_p, c_uint64, c_uint64, c_void_p, c_size_t], c_int),
    "rgpu_cublas_set_dnn": ([c_void_p, c_void_p], None),
    "rgpu_cudnn_new": ([c_void_p, c_void_p], c_void_p),
    "rgpu_cudnn_free": ([c_void_p], None),
    "rgpu_cudnn_add": ([c_void_p, c_int, c_uint64, c_uint64], c_int),
    "rgpu_cudnn_remove": ([c_void_p, c_int, c_uint64], None),
    "rgpu_cudnn_count": ([c_void_p, c_int], c_size_t),
    "rgpu_cudnn_stream": ([c_void_p, c_uint64, c_uint64], c_int),
    "rgpu_cudnn_record": ([c_void_p, c_uint64, c_uint64, c_void_p, c_size_t], c_int),
    "rgpu_cudnn_bind_packs": ([c_void_p, c_void_p, c_void_p, c_void_p, c_void_p], None),
    "rgpu_cudnn_real": ([c_void_p, c_int, c_uint64], c_uint64),
    "rgpu_cudnn_pack_attr": ([c_void_p, c_uint64, c_int, POINTER(c_int32), POINTER(c_uint64), c_size_t], c_int64),
    "rgpu_cudnn_desc_record": ([c_void_p, c_uint32, c_uint64, c_void_p, c_size_t], c_int),
    "rgpu_cudnn_bind_tensors": ([c_void_p, c_void_p, c_void_p, c_void_p, c_void_p], None),
    "rgpu_cudnn_tensor": ([c_void_p, c_uint64, POINTER(c_int32)], c_uint64),
    "rgpu_cudnn_bind_bn": ([c_void_p, c_void_p, c_void_p, c_void_p], None),
}


def build(force: bool = False) -> Path:
    """The built library's path (a ``BuildError`` when it cannot be built here)."""
    return native.build_library(NAME, SOURCES, include_dirs=[protocol.HEADER_DIR],
                                key_extra=protocol.HEADER.read_text() + protocol.HEADER_LIBS.read_text(), force=force)


@functools.lru_cache(maxsize=None)
def _library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled library, its functions typed (``SIGNATURES``), or None when it cannot be built here."""
    path = native.attempt(NAME, build)
    return None if path is None else _library(str(path))

