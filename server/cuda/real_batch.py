"""The real driver's batch launcher: ``launch_records.c`` walks the interceptor's launch records and launches each.

A ctypes call costs about as much as the launch itself (docs/perf/cuda_route-history.md),
so a batch of records goes to C in one call.  Built with the host's C
compiler (``rgpu.native``) ahead by ``rgpu build`` or on first use, and cached;
where there is none, or ``RGPU_NATIVE=off``, the executor walks the records in
Python instead (``load()`` returns None, ``native.why_not(NAME)`` says why).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from rgpu import native, protocol

NAME = "launch_records"
SOURCE = Path(__file__).resolve().parent / "launch_records.c"


def build(force: bool = False) -> Path:
    """The built library's path (a ``BuildError`` when it cannot be built here)."""
    return native.build_library(NAME, [SOURCE], include_dirs=[protocol.HEADER_DIR],
                                key_extra=protocol.HEADER.read_text(), force=force)


def load():
    """The compiled ``rgpu_launch_records`` (typed), or None when it cannot be built here."""
    path = native.attempt(NAME, build)
    if path is None:
        return None
    fn = ctypes.CDLL(str(path)).rgpu_launch_records
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint64)]
    fn.restype = ctypes.c_int
    return fn
