"""Copies into and out of shared segments: numba's parallel loop where it wins, one memcpy elsewhere.

Measured (docs/perf/transport.md): on an idle 2-core machine a jitted ``prange``
copy beats one-thread ``numpy.copyto`` by 1.1-2x from 1 MiB up, but with the
cores busy (other processes, the peer spinning) it falls to a fraction of it,
and a pool of Python threads running ``copyto`` on slices loses everywhere. So
the parallel copy is used only where there are ``MIN_CORES`` cores or more and
the copy is at least ``PARALLEL_MIN``. numba is optional: without it (or in a
forked child, where its thread pool is not safe) every copy is one memcpy.
"""
from __future__ import annotations

import os
import threading

import numpy as np

PARALLEL_MIN = 4 << 20
MIN_CORES = 4
MAX_THREADS = 8            # memory bandwidth is saturated well before this on the hosts we measured

_lock = threading.Lock()
_kernel = None             # the jitted copy; False when numba is absent or failed to compile
_threads = 1
_enabled = False           # whether copy() uses it (cores >= MIN_CORES)
_owner_pid = None


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _compile() -> None:
    global _kernel, _threads
    if _kernel is not None:
        return
    try:
        import numba
        from numba import njit, prange

        @njit(parallel=True, nogil=True, cache=True)
        def pcopy(dst, src, nchunks):  # pragma: no cover - runs compiled
            n = src.size
            step = (n + nchunks - 1) // nchunks
            for c in prange(nchunks):
                lo = c * step
                hi = min(n, lo + step)
                dst[lo:hi] = src[lo:hi]

        probe = np.arange(64, dtype=np.uint8)
        out = np.empty_like(probe)
        pcopy(out, probe, 2)
        readonly = probe.copy()
        readonly.setflags(write=False)   # bytes and read-only views arrive as read-only arrays
        pcopy(out, readonly, 2)
        if not np.array_equal(out, probe):
            raise RuntimeError("numba copy gave wrong bytes")
        _threads = max(1, min(MAX_THREADS, numba.config.NUMBA_NUM_THREADS))
        _kernel = pcopy
    except Exception:  # no numba, no compiler cache, an unsupported platform: memcpy it is
        _kernel = False


def _setup() -> None:
    global _enabled, _owner_pid
    with _lock:
        if _owner_pid is not None:
            return
        wanted = cores() >= MIN_CORES
        if wanted:
            _compile()
        _enabled = wanted and bool(_kernel) and _threads > 1
        _owner_pid = os.getpid()


def warm_up() -> None:
    """Compile (or load from numba's cache) the parallel copy now, where a pause is harmless.

    Never in a background thread: a compile holds the GIL for a second or more, and
    every call that needs Python meanwhile waits out the 5 ms switch interval
    (on the GPU host a short driver call took the whole interval, streamed ops slowed alike:
    docs/perf/transport-history.md, the parallel copy).
    """
    if _owner_pid is None and cores() >= MIN_CORES:
        _setup()


def memcpy_only() -> None:
    """This process copies with one memcpy and never compiles (what ``warm_up`` would start is skipped).

    For processes that are someone else's program (the CUDA interceptor inside a C or numba
    program): a compile in a background thread holds the GIL for a second or more, and every
    driver call entering Python meanwhile waits out the 5 ms switch interval
    (docs/perf/transport-history.md, the parallel copy); a compile still running at exit can abort the process.
    """
    global _enabled, _owner_pid
    with _lock:
        if _owner_pid is None:
            _enabled, _owner_pid = False, os.getpid()


def backend() -> str:
    """What big copies use here: ``numba-prange-xN`` or ``memcpy``."""
    _setup()
    return f"numba-prange-x{_threads}" if _enabled else "memcpy"


def copy(dst: memoryview, src) -> None:
    """Copy ``src`` (any bytes-like of the same size) into ``dst``; parallel when big and worth it here."""
    if _enabled and dst.nbytes >= PARALLEL_MIN and _owner_pid == os.getpid():
        _kernel(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8), _threads)
        return
    if _owner_pid is None and dst.nbytes >= PARALLEL_MIN:
        _setup()   # the first big copy pays for the compile once (numba caches it on disk)
        if _enabled:
            _kernel(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8), _threads)
            return
    dst[:] = src


def parallel_copy(dst, src, threads: int | None = None) -> None:
    """The jitted parallel copy whatever the core count (the benchmark that decides uses it)."""
    with _lock:
        _compile()
    if not _kernel:
        raise RuntimeError("numba is not available here")
    _kernel(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8),
            threads or max(1, min(MAX_THREADS, cores())))
