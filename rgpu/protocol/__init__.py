"""``rgpu.protocol``: the numbers both ends and both languages agree on, in one place.

    wire.py            the frame's magic, version, header size, kinds and flags; the shm ring's record kinds
    ops.py             the ops route's messages (``Msg``), allocator events, value tags, dtype codes
    cuda.py            the cuda route's CUresult numbers and its launch record
    cuda_libs.py       the math libraries' forwarded calls (lib_cublas.py, lib_cublaslt.py, lib_cudnn.py)
    header.py          writes ``rgpu_protocol.h`` from the three (``python -m rgpu.protocol.header --write``)
    rgpu_protocol.h    generated: what the C and C++ parts include instead of typing the numbers again
    rgpu_protocol_libs.h  generated: the math libraries' call ids and payload structs (C only)

Imports nothing of rgpu but ``rgpu.errors``-free leaves; no torch, no msgpack.
"""
from __future__ import annotations

from pathlib import Path

HEADER_DIR = Path(__file__).resolve().parent   # the folder C and C++ builds add to their include path
HEADER = HEADER_DIR / "rgpu_protocol.h"
HEADER_LIBS = HEADER_DIR / "rgpu_protocol_libs.h"   # the math libraries' calls (cuda_libs), C only
