"""The C queue's records other than launches, as the driver ops the Python path would have posted.

The interceptor queues memsets, event records, stream waits, frees, small
host-to-device copies, device-to-device copies, graph launches and the math libraries' calls in the
same buffer as its launches (``cuda_intercept/shim_queue.c``; the layout is ``rgpu.protocol.cuda.OP``), so
the server runs them in the order the program made them.  ``decode`` turns one
into ``(op, args, buffers)`` exactly as ``calls_memory.py``/``calls_order.py``
send it, so the route runs it through the same door as a posted call (its
quotas, its deferred error named by the op) on the real driver or the fake.
"""
from __future__ import annotations

from rgpu.protocol.cuda import (
    EVENT_RECORD_KIND, GRAPH_LAUNCH_KIND, LIB_KIND, MEM_FREE_KIND, MEMCPY_DTOD_KIND, MEMCPY_HTOD_KIND, MEMSET_KIND,
    NO_STREAM, OP, QUEUED_COPY_BYTES, STREAM_WAIT_KIND,
)

KINDS = frozenset({MEMSET_KIND, EVENT_RECORD_KIND, STREAM_WAIT_KIND, MEM_FREE_KIND, MEMCPY_HTOD_KIND,
                   GRAPH_LAUNCH_KIND, LIB_KIND, MEMCPY_DTOD_KIND})


def decode(records: memoryview, pos: int, end: int):
    """``(size, ctx, op, args, buffers)`` of the record at ``pos``, or None when it is malformed.

    ``buffers`` are views into ``records`` (a copy's bytes, valid while the batch is).
    """
    if pos + OP.size > end:
        return None
    size, kind, ctx, stream, a, b, c = OP.unpack_from(records, pos)
    if size < OP.size or size % 8 or pos + size > end:
        return None
    s = None if stream == NO_STREAM else stream        # the synchronous forms: the drivers' stream None
    if kind == MEMSET_KIND:
        elem = b >> 32
        return (size, ctx, "memset", [a, b & 0xFFFFFFFF, elem, c, s], []) if elem in (1, 2, 4) else None
    if kind == EVENT_RECORD_KIND:
        return size, ctx, "event_record", [a, stream, b], []
    if kind == STREAM_WAIT_KIND:
        return size, ctx, "stream_wait_event", [stream, a, b], []
    if kind == MEM_FREE_KIND:
        return (size, ctx, "mem_free", [a], []) if s is None else (size, ctx, "mem_free_async", [a, s], [])
    if kind == MEMCPY_HTOD_KIND:
        if b > QUEUED_COPY_BYTES or OP.size + b > size:
            return None
        return size, ctx, "memcpy_htod", [a, s], [records[pos + OP.size:pos + OP.size + b]]
    if kind == MEMCPY_DTOD_KIND:
        return size, ctx, "memcpy_dtod", [a, b, c, s], []
    if kind == GRAPH_LAUNCH_KIND:
        return size, ctx, "graph_launch", [a, stream], []
    if kind == LIB_KIND:                               # a math library's call (server/cuda/libs)
        if OP.size + c > size:
            return None
        return size, ctx, "lib_record", [a, b, stream], [records[pos + OP.size:pos + OP.size + c]]
    return None
