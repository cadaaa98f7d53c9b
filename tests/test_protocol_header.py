"""The C header of rgpu.protocol is what its generator writes, and the C and C++ parts read their numbers from it."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from rgpu.protocol import HEADER, HEADER_LIBS, cuda, header, ops, wire

ROOT = Path(__file__).resolve().parent.parent
INCLUDERS = ("device_backend/rgpu_device.h", "server/ops/fast_op.cpp", "server/ops/handle_table.h",
             "transport/shm_fast.c", "cuda_intercept/shim.c", "server/cuda/launch_records.c")


def _defines() -> dict[str, str]:
    return dict(re.findall(r"^#define (RGPU_\w+) (.+)$", HEADER.read_text(), re.M))


def test_the_committed_header_is_what_the_generator_writes():
    assert HEADER.read_text() == header.render(), "stale: run python -m rgpu.protocol.header --write"
    assert HEADER_LIBS.read_text() == header.render_libs(), "stale: run python -m rgpu.protocol.header --write"


def test_every_math_library_call_has_its_id_and_a_payload_struct_of_its_size():
    from rgpu.protocol import cuda_libs
    text = HEADER_LIBS.read_text()
    for call in cuda_libs.CALLS.values():
        assert f"#define RGPU_LIB_{call.name} " + f"{call.id:#X}u".replace("0X", "0x") in text
        assert f"sizeof(rgpu_lib_{call.name}_t) == {max(call.format.size, 1)}" in text


def test_the_generator_checks_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "rgpu.protocol.header", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_header_holds_every_message_kind_tag_and_record_the_c_parts_use():
    d = _defines()
    assert {f"RGPU_KIND_{k.name}": str(k.value) for k in wire.MsgKind}.items() <= d.items()
    assert {f"RGPU_MSG_{m.name}": str(m.value) for m in ops.Msg}.items() <= d.items()
    assert {f"RGPU_TAG_{header.TAG_NAMES[t]}": f'"{t}"' for t in ops.TAG}.items() <= d.items()
    assert d["RGPU_WIRE_HEADER_BYTES"] == "36" and d["RGPU_SHM_RECORD_BYTES"] == "24"
    assert d["RGPU_CUDA_LAUNCH_HEADER_BYTES"] == str(cuda.LAUNCH.size) == "64"
    assert d["RGPU_WIRE_MAGIC_U32"] == "0x55504752u"


def test_the_c_parts_include_the_header():
    missing = [p for p in INCLUDERS if '#include "rgpu_protocol.h"' not in (ROOT / p).read_text()]
    assert not missing, missing


def test_both_ends_of_the_cuda_route_share_one_curesult_table():
    from rgpu.cuda_intercept import registry
    from rgpu.server.cuda import base

    for module in (registry, base):
        for name in dir(module):
            if name.startswith("CUDA_ERROR_") or name == "CUDA_SUCCESS":
                assert getattr(module, name) == cuda.CURESULTS[name], (module.__name__, name)
