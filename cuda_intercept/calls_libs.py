"""The math libraries' answered calls (``rgpu_lib_call`` in shim_libs.c): one request each, the queue first.

rgpu's libcublas.so.13, libcublasLt.so.13 and libcudnn.so.9 queue most of their calls in C; the ones whose
caller needs an answer (a handle's creation, a heuristic query, a plan's finalisation) come here. The
payload goes as the request's buffer; the reply is ``[status, message]`` and, when the call has output,
its bytes, copied into the caller's ``out`` (at most ``cap`` bytes; ``*got`` says how many there were).
"""
from __future__ import annotations

from rgpu.protocol.cuda_libs import CALLS

from .registry import say_once


def lib_call(c, ffi, call: int, stream: int, handle: int, payload, n: int, out, cap: int, status, got) -> int:
    name = CALLS[call].name if call in CALLS else f"math library call {call:#x}"
    c.waits[name] += 1
    value, bufs = c.call("lib_call", call, handle, stream, buffers=[ffi.buffer(payload, n)] if n else [])
    st, message = value[0], value[1] if len(value) > 1 else None
    status[0] = st
    got[0] = 0
    if message:
        say_once(f"{name}: {message}")
    if bufs:
        views, reply = bufs
        try:
            data = views[0]
            got[0] = data.nbytes
            if out != ffi.NULL and cap:
                ffi.memmove(out, data[:min(cap, data.nbytes)], min(cap, data.nbytes))
        finally:
            reply.release()
    return 0
