"""cuBLASLt's forwarded calls (``cuda_intercept/lib_cublaslt.c`` on the client, ``server/cuda/libs/cublaslt_*.py``).

Descriptors, layouts and preferences never leave the client: they travel as attribute sets inside the
heuristic query (answered, cached on the client by content) and the matmul record (queued).
"""
from __future__ import annotations

from .cuda_libs import LibCall

IDS = (0x200, 0x300)

CALLS: tuple[LibCall, ...] = ()
