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

import struct
from dataclasses import dataclass

# struct code -> C type of a payload field (the generated header's structs)
C_TYPES = {"Q": "uint64_t", "q": "int64_t", "I": "uint32_t", "i": "int32_t", "d": "double", "f": "float"}


@dataclass(frozen=True)
class LibCall:
    id: int
    name: str                          # the library function it forwards: what an error names
    fields: tuple[tuple[str, str], ...] = ()   # (field, struct code); "16s" a 16-byte field (a scalar, an algo)
    sync: bool = False                 # answered (its caller needs the output), else queued

    @property
    def format(self) -> struct.Struct:
        return struct.Struct("<" + "".join(code for _, code in self.fields))

    def c_struct(self) -> str:
        """The payload's fixed part as a packed C struct."""
        lines = []
        for name, code in self.fields:
            if code.endswith("s"):
                lines.append(f"    uint8_t {name}[{int(code[:-1])}];")
            else:
                lines.append(f"    {C_TYPES[code]} {name};")
        body = "\n".join(lines) if lines else "    uint8_t _none;"   # C has no empty structs
        return f"typedef struct __attribute__((packed)) {{\n{body}\n}} rgpu_lib_{self.name}_t;"


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
