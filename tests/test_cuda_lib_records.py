"""cuBLAS's queued GEMM records run in C beside the launches (server/cuda/libs/cublas_records.c): the same
calls, arguments and setters as the Python path, malformed or failing records refused with a clear error.

No GPU: NVIDIA's libraries are the bench's stand-in (bench/cuda_lib_standin.c), which logs every call it gets;
each test in a forked child (tests/cuda_lib_fixtures.py, shared with the cuBLASLt and cuDNN record tests).
"""
from __future__ import annotations

import struct

import pytest
from cuda_lib_fixtures import CTX, DEFAULT, S1, S2, gemm, isolated, launch, run, session_of
from cuda_lib_fixtures import folder, pytestmark  # noqa: F401 (the stand-in's fixture, its skip)

from rgpu.bench import cuda_lib_records as bench
from rgpu.protocol.cuda import LIB_KIND, OP
from rgpu.protocol.cuda_libs import BY_NAME

DEVICE_SCALARS = dict(pointer_mode=1, alpha=(0xA1F0).to_bytes(16, "little"), beta=(0xBE70).to_bytes(16, "little"))
GEMV = dict(bench.GEMM)
STEP = b"".join([            # a step's records: state changes, every GEMM kind, a launch, a call C leaves to Python
    gemm("cublasSgemm_v2"),
    launch(0x100, S1),
    gemm("cublasGemmEx", workspace=0xE000, workspace_size=4096),
    bench.record("cublasSgemv_v2", bench.HANDLE, S1, bench.pack(
        "cublasSgemv_v2", workspace=0xE000, workspace_size=4096, trans=0, m=4, n=4, lda=4, incx=1, incy=1,
        alpha=bench.SCALAR, A=0xA000, x=0xB000, y=0xC000), ctx=CTX),
    gemm("cublasGemmStridedBatchedEx", workspace=0xE000, workspace_size=4096, math_mode=3),
    gemm("cublasDgemm_v2", workspace=0xE000, workspace_size=4096, math_mode=3, **DEVICE_SCALARS),
    gemm("cublasSgemmStridedBatched", stream=S2, math_mode=3),
    launch(0x200, S2),
    gemm("cublasDgemmStridedBatched", stream=S2, alpha=struct.pack("<d", -2.0).ljust(16, b"\0")),
])


@isolated
def test_the_c_walker_and_the_python_path_make_the_same_calls(folder, monkeypatch):
    logs = {}
    for native in ("auto", "off"):
        session = session_of(folder, monkeypatch, native)
        logs[native], through_python = run(session, STEP * 2, monkeypatch)
        assert session.executor.deferred == []
        assert through_python == (2 if native == "auto" else 14)    # in C: all but the two GEMVs
        session.libs.close()
        assert session.std.standin_take().decode().splitlines()[-1].startswith("destroy ")
    assert logs["auto"] == logs["off"]
    step = logs["auto"][:18]                                 # the first step, and the second's first setter
    h = step[1].split()[1]                                   # the real handle, as the stand-in minted it
    assert step[0] == "ctx 7" and step[1] == f"stream {h} {S1:x}" and step[17] == step[1]
    assert [line.split()[0] for line in step[2:]] == [
        "sgemm", "launch", "workspace", "gemmex", "sgemv", "math", "gemm_strided_ex", "pointer", "dgemm",
        "stream", "pointer", "sgemm_strided", "launch", "math", "dgemm_strided", "stream"]
    assert step[10] == f"dgemm {h} 0 1 128 128 128 a1f0 a000 128 b000 128 be70 c000 128"   # device scalars
    assert step[11] == f"stream {h} {S2:x}"       # a new stream: the library's pool again, no workspace call
    one = struct.unpack("<Q", struct.pack("<f", 1.0).ljust(8, b"\0"))[0]
    assert step[2] == f"sgemm {h} 0 1 128 128 128 {one:x} a000 128 b000 128 0 c000 128"   # host scalars by value


@isolated
def test_malformed_unknown_and_failing_records_are_refused_with_clear_errors(folder, monkeypatch):
    for native in ("auto", "off"):
        session = session_of(folder, monkeypatch, native)
        ok = gemm("cublasGemmEx")
        short = OP.pack(OP.size + 24, LIB_KIND, CTX, S1, BY_NAME["cublasSgemm_v2"].id, bench.HANDLE, 20) + bytes(24)
        unknown_call = OP.pack(OP.size, LIB_KIND, CTX, S1, 0x1FF, bench.HANDLE, 0)
        records = (ok + short + gemm("cublasSgemm_v2", handle=0x99) + gemm("cublasSgemm_v2", lda=2) + unknown_call
                   + ok)
        log, _ = run(session, records, monkeypatch)
        messages = [message for _, _, message in session.executor.deferred]
        assert len(messages) == 4, messages
        assert "cublasSgemm_v2: a payload of 20 bytes, expected at least 112" in messages[0]
        assert "0x99 is not a cuBLAS handle of this session" in messages[1]
        assert "CUBLAS_STATUS_INVALID_VALUE" in messages[2]
        assert "unknown math library call 511" in messages[3]
        assert [line.split()[0] for line in log].count("gemmex") == 2       # the rest still ran, in order
        session.executor.deferred.clear()
        overrun = OP.pack(OP.size, LIB_KIND, CTX, S1, BY_NAME["cublasSgemm_v2"].id, bench.HANDLE, 4096)
        from rgpu.server.route import OpFailed
        with pytest.raises(OpFailed, match="malformed .*record.* at byte 0"):
            session.executor._launches(memoryview(bytearray(overrun)))
        session.libs.close()


def test_the_c_table_refuses_short_payloads_and_unknown_calls_itself(folder, monkeypatch):
    from rgpu.server.cuda import real_batch
    if real_batch.library() is None:
        pytest.skip("the server's C part does not build here")
    _table_refuses(folder, monkeypatch)


@isolated
def _table_refuses(folder, monkeypatch):
    from rgpu.server.cuda import real_batch
    c = real_batch.library()
    session = session_of(folder, monkeypatch, "auto")
    table = session.libs.records_table()
    payload = bench.pack("cublasGemmEx", **bench.EX, workspace_size=DEFAULT)
    assert c.rgpu_cublas_record(table, BY_NAME["cublasGemmEx"].id, bench.HANDLE, S1, payload, len(payload)) == 0
    assert c.rgpu_cublas_record(table, BY_NAME["cublasGemmEx"].id, bench.HANDLE, S1, payload, 100) == -1
    assert c.rgpu_cublas_record(table, BY_NAME["cublasSgemv_v2"].id, bench.HANDLE, S1, payload, len(payload)) == -2
    assert c.rgpu_cublas_record(table, BY_NAME["cublasGemmEx"].id, 0x99, S1, payload, len(payload)) == -2
    assert c.rgpu_cublas_record(None, BY_NAME["cublasGemmEx"].id, bench.HANDLE, S1, payload, len(payload)) == -2
    monkeypatch.setattr(session.libs, "trace", True)        # a trace sees every call: the walker gets no table
    assert session.libs.records_table() is None
    session.libs.close()


@isolated
def test_the_bench_gives_its_rows(folder, monkeypatch):
    monkeypatch.setenv("RGPU_CUDA_LIB_DIR", folder)
    rows = bench.rows(bench.harness.parser(bench.__doc__).parse_args(["--quick", "--repeats", "1"]))
    assert [r["record"] for r in rows] == list(bench.cases())
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in rows)


@isolated
def test_a_matmuls_state_is_parsed_once_and_its_bias_pointer_set_when_it_changes(folder, monkeypatch):
    session = session_of(folder, monkeypatch, "auto")

    def matmul(bias: int) -> bytes:
        state = bench._lt_state().replace(struct.pack("<Q", 0xBEEF00), struct.pack("<Q", bias))
        return bench.record("cublasLtMatmul", bench.HANDLE, S1, bench.pack(
            "cublasLtMatmul", alpha=bench.SCALAR, a=0xA000, b=0xB000, c=0xC000, d=0xC000, tail=state), ctx=CTX)
    log, _ = run(session, matmul(0xB100) + matmul(0xB100) + matmul(0xB200) + matmul(0xB100), monkeypatch)
    assert session.executor.deferred == []
    made = [line.split()[0] for line in log if line.split()[0] in ("desc", "layout")]
    assert made == ["desc", "layout"]                     # one descriptor, one layout (the four are alike)
    biases = [line.split()[3] for line in log if line.startswith("desc_set") and line.split()[2] == "8"]
    assert biases == ["b100", "b200", "b100"]             # set when it changed, not per call
    assert [line.split()[0] for line in log].count("lt_matmul") == 4
    lib = session.libs.library("cublaslt")
    assert len(lib.resolved) == 2 and lib.live() == 2
    session.libs.close()
