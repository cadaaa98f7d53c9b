"""Writes ``rgpu_protocol.h``, the C view of ``rgpu.protocol``: ``python -m rgpu.protocol.header --write | --check``.

The C and C++ parts (``device_backend/*.cpp``, ``server/ops/fast_op.cpp``,
``transport/shm_fast.c``, ``cuda_intercept/shim*.c``) include the header instead
of typing the numbers again; ``--check`` (and ``tests/test_protocol_header.py``)
fails when the committed header is not what this writes.
"""
from __future__ import annotations

import argparse
import sys

from . import HEADER, cuda, cuda_libs, ops, wire

# The C names of the ops route's value tags (ops.TAG): a new tag needs its name here.
TAG_NAMES = {"t": "TENSOR", "j": "MATH_BITS", "s": "CPU_SCALAR", "d": "DTYPE", "v": "DEVICE", "l": "LAYOUT",
             "m": "MEMORY_FORMAT", "c": "COMPLEX", "g": "GENERATOR"}


def _define(name: str, value, hex_: bool = False) -> str:
    if isinstance(value, str):
        text = '"' + value + '"'
    elif hex_ or value > 0x7FFFFFFF:
        text = f"{value:#X}u".replace("0X", "0x")
    else:
        text = str(int(value))
    return f"#define {name} {text}"


def render() -> str:
    """The header's text, from the Python tables."""
    missing = set(ops.TAG) - set(TAG_NAMES)
    if missing:
        raise KeyError(f"rgpu.protocol.header: no C name for the value tags {sorted(missing)} (TAG_NAMES)")
    lines = [
        "/* rgpu_protocol.h: the numbers both languages agree on, generated from rgpu.protocol's tables",
        " * by rgpu/protocol/header.py; do not edit (python -m rgpu.protocol.header --write). */",
        "#ifndef RGPU_PROTOCOL_H",
        "#define RGPU_PROTOCOL_H",
        "",
        "/* wire.py: the frame */",
        _define("RGPU_WIRE_MAGIC", wire.MAGIC.decode()),
        _define("RGPU_WIRE_MAGIC_U32", int.from_bytes(wire.MAGIC, "little"), hex_=True),
        _define("RGPU_PROTOCOL_VERSION", wire.PROTOCOL_VERSION),
        _define("RGPU_WIRE_HEADER_BYTES", wire.HEADER.size),
        *(_define(f"RGPU_KIND_{k.name}", k.value) for k in wire.MsgKind),
        *(_define(f"RGPU_FLAG_{f.name}", f.value) for f in wire.Flags if f.value),
        "",
        "/* wire.py: the shm ring's records */",
        _define("RGPU_SHM_RECORD_BYTES", wire.SHM_RECORD.size),
        _define("RGPU_SHM_KIND_FRAME", wire.SHM_KIND_FRAME),
        _define("RGPU_SHM_KIND_WRAP", wire.SHM_KIND_WRAP),
        _define("RGPU_SHM_NO_SLOT", wire.SHM_NO_SLOT),
        "",
        "/* ops.py: messages (the first item of each), allocator events, value tags */",
        *(_define(f"RGPU_MSG_{m.name}", m.value) for m in ops.Msg),
        *(_define(f"RGPU_EVENT_{e.name}", e.value) for e in ops.Event),
        *(_define(f"RGPU_EVENT_{e.name}_FIELDS", n) for e, n in ops.EVENT_FIELDS.items()),
        *(_define(f"RGPU_TAG_{TAG_NAMES[t]}", t) for t in ops.TAG),
        "",
        "/* cuda.py: the interceptor's launch record (its fixed part, then the arguments) */",
        _define("RGPU_CUDA_REC_LAUNCH", cuda.LAUNCH_KIND),
        _define("RGPU_CUDA_REC_LAUNCH_EX", cuda.LAUNCH_EX_KIND),
        _define("RGPU_CUDA_LAUNCH_HEADER_BYTES", cuda.LAUNCH.size),
        "/* cuda.py: the queue's other records (memsets, events, waits, frees, small copies, graph launches) */",
        _define("RGPU_CUDA_RECORD_HEAD_BYTES", cuda.RECORD_HEAD.size),
        _define("RGPU_CUDA_OP_HEADER_BYTES", cuda.OP.size),
        _define("RGPU_CUDA_REC_MEMSET", cuda.MEMSET_KIND),
        _define("RGPU_CUDA_REC_EVENT_RECORD", cuda.EVENT_RECORD_KIND),
        _define("RGPU_CUDA_REC_STREAM_WAIT", cuda.STREAM_WAIT_KIND),
        _define("RGPU_CUDA_REC_MEM_FREE", cuda.MEM_FREE_KIND),
        _define("RGPU_CUDA_REC_MEMCPY_HTOD", cuda.MEMCPY_HTOD_KIND),
        _define("RGPU_CUDA_REC_GRAPH_LAUNCH", cuda.GRAPH_LAUNCH_KIND),
        f"#define RGPU_CUDA_NO_STREAM {cuda.NO_STREAM:#X}ull".replace("0X", "0x"),   # 64 bits: ull
        _define("RGPU_CUDA_QUEUED_COPY_BYTES", cuda.QUEUED_COPY_BYTES),
        _define("RGPU_CUDA_REC_LIB", cuda.LIB_KIND),
        "",
        "/* cuda_libs.py: the math libraries' forwarded calls (ids, payloads; C only: the C++ parts need none) */",
        "#ifndef __cplusplus",
        "#include <stdint.h>",
        *(line for call in sorted(cuda_libs.CALLS.values(), key=lambda c: c.id) for line in (
            _define(f"RGPU_LIB_{call.name}", call.id, hex_=True),
            call.c_struct(),
            f"_Static_assert(sizeof(rgpu_lib_{call.name}_t) == {max(call.format.size, 1)}, \"{call.name}'s payload\");")),
        "#endif",
        "",
        "#endif /* RGPU_PROTOCOL_H */",
        "",
    ]
    return "\n".join(lines)


def stale() -> bool:
    """Whether the header on disk differs from what ``render()`` writes."""
    return not HEADER.exists() or HEADER.read_text() != render()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rgpu.protocol.header", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="write rgpu_protocol.h")
    g.add_argument("--check", action="store_true", help="exit 1 when rgpu_protocol.h is stale")
    args = p.parse_args(argv)
    if args.write:
        HEADER.write_text(render())
        return 0
    if stale():
        print(f"{HEADER} is stale: run python -m rgpu.protocol.header --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
