"""cuDNN's forwarded calls (``cuda_intercept/lib_cudnn.c`` on the client, ``server/cuda/libs/cudnn_*.py``).

Handles and descriptors are minted on the client; the server maps them, inside attribute payloads too.
"""
from __future__ import annotations

from .cuda_libs import LibCall

IDS = (0x300, 0x400)

CALLS: tuple[LibCall, ...] = ()
