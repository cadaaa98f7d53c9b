"""The math libraries' calls on the cuda route: cuBLAS, cuBLASLt and cuDNN, forwarded whole to the server.

rgpu's ``libcublas.so.13``, ``libcublasLt.so.13`` and ``libcudnn.so.9`` (``cuda_intercept/lib_*.c``) turn a
call into one of these, by number, and hand it to rgpu's ``libcuda.so.1`` (``cuda_intercept/shim_libs.c``):

- **queued** (``sync=False``): one record in the same C queue as the launches (``cuda.LIB_KIND``: the ``OP``
  header with a = call id, b = the call's handle, c = payload bytes; then the payload), so a GEMM never
  overtakes the kernel that wrote its input. A failing status comes back as a deferred error, raised at
  the next synchronising call (as a kernel fault is).
- **answered** (``sync=True``, or any call when C cannot queue): a request ``["lib_call", ctx, call,
  handle, stream]`` with the payload as its buffer; the reply's value is ``[status, message]``
  (the library's own status; a message when it failed) and its buffer, if any, the call's output.

A payload is the call's fixed fields, a packed little-endian struct (``fields``: ``struct`` codes; the
C side's ``rgpu_lib_<name>_t`` is generated into ``rgpu_protocol.h``), then a variable tail the call
defines (attribute bytes, a serialized descriptor). Pointers into device memory are the server's
addresses and pass through; host scalars travel by value; handles and descriptors are minted on the
client and mapped by the server's session (``server/cuda/libs/``).

Each library's calls are in its own module (``lib_cublas``, ``lib_cublaslt``, ``lib_cudnn``), in its
own range of ids; this module collects them.
"""
from __future__ import annotations

from .lib_call import LibCall


def _collect() -> dict[int, LibCall]:
    from . import lib_cublas, lib_cublaslt, lib_cudnn

    calls: dict[int, LibCall] = {}
    for module in (lib_cublas, lib_cublaslt, lib_cudnn):
        lo, hi = module.IDS
        for call in module.CALLS:
            if not lo <= call.id < hi:
                raise ValueError(f"{module.__name__}: {call.name} has id {call.id:#x}, outside [{lo:#x}, {hi:#x})")
            if call.id in calls:
                raise ValueError(f"{call.name} and {calls[call.id].name} share id {call.id:#x}")
            calls[call.id] = call
    return calls


CALLS: dict[int, LibCall] = _collect()
BY_NAME: dict[str, LibCall] = {c.name: c for c in CALLS.values()}
