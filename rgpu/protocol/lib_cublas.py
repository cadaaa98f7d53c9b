"""cuBLAS's forwarded calls (``cuda_intercept/lib_cublas.c`` on the client, ``server/cuda/libs/cublas_*.py``).

Handles are minted on the client; the stream, workspace and math mode are kept there by the setters and
travel in the records that use them (see ``cuda_libs`` for the record and request shapes).
"""
from __future__ import annotations

from .cuda_libs import LibCall

IDS = (0x100, 0x200)

CALLS: tuple[LibCall, ...] = (
    # the server creates the real handle; the reply's status says whether its library loaded (version checked)
    LibCall(0x100, "cublasCreate", (("client_version", "i"),), sync=True),
    LibCall(0x101, "cublasDestroy"),
)
