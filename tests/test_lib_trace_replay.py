"""Math-library call traces (``server/cuda/libs/trace.py``) replayed against the fake cuBLAS, cuBLASLt and cuDNN.

Every trace in ``tests/lib_traces/`` (recorded on a GPU host: ``RECORD=1 bash gpu/check_cuda_libs.sh``) is
replayed: each call's status must be the GPU's, each GEMM's output within ``trace.TOLERANCE`` of the GPU's
bytes, and every handle and descriptor freed at the session's end. Until one is committed, traces recorded
here against the fake server (the cuBLAS and cuBLASLt C programs through rgpu's client libraries) show the
recorder and replayer work, and a changed output byte is caught.
"""
from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import msgpack
import pytest

from test_cuda_lib_cublas import build, folder  # noqa: F401 (fixture)
from test_cuda_programs import run

TRACES = Path(__file__).parent / "lib_traces"
LT_PROGRAM = Path(__file__).parent / "lib_programs" / "cublaslt_matmul.c"


@pytest.fixture(scope="module")
def recorded(folder, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """The traces of the two C programs run through rgpu against a recording fake server."""
    from conftest import RunningServer
    work = tmp_path_factory.mktemp("lib-trace")
    lt = work / "cublaslt_matmul"
    subprocess.run(["cc", "-std=gnu11", "-O1", str(LT_PROGRAM), "-o", str(lt), f"-L{folder}",
                    "-l:libcublasLt.so.13", "-l:libcublas.so.13", "-l:libcuda.so.1"], check=True)
    server = RunningServer(work / "server", ("--cuda-driver", "fake"), env={"RGPU_CUDA_LIB_RECORD": str(work / "traces")})
    try:
        for exe in (build(folder, work), lt):
            done = run([exe], server)
            assert done.returncode == 0, done.stderr[-2000:]
    finally:
        server.stop()
    paths = sorted((work / "traces").glob("*.rgputrace"))
    assert paths, f"no trace written: {server.stderr[-2000:]}"
    return paths


def test_a_recorded_session_has_every_call_the_gemms_bytes_and_a_footer(recorded):
    from rgpu.server.cuda.libs import trace
    names, with_bytes = set(), 0
    for path in recorded:
        header, calls, end = trace.load(path)
        assert header["flavour"] == "fake" and end is not None, path
        names |= {c["name"] for c in calls}
        with_bytes += sum(1 for c in calls if c.get("outputs"))
    assert {"cublasCreate_v2", "cublasSgemm_v2", "cublasGemmEx", "cublasLtMatmul", "cublasSgemv_v2"} <= names
    assert with_bytes >= 10


def test_the_recorded_traces_replay_into_the_fake_libraries_equal_and_freed(recorded):
    from rgpu.server.cuda.libs import trace
    for path in recorded:
        rep = trace.replay(path)
        assert rep["ok"], rep
        assert rep["replayed"] > 0 and not any(rep["live_after_close"].values())
    assert sum(trace.replay(p)["compared"] for p in recorded) >= 10


def test_a_changed_output_value_and_a_changed_status_are_caught(recorded, tmp_path):
    from rgpu.server.cuda.libs import trace
    path = next(p for p in recorded if any(c.get("outputs") for c in trace.load(p)[1]))
    header, calls, end = trace.load(path)
    target = next(c for c in calls if c.get("outputs") and c["outputs"][0][4] == "float32")
    out = target["outputs"][0]
    out[3] = b"\x00\x00\x80\x7f" + out[3][4:]               # +inf where the GPU wrote a finite float
    create = next(c for c in calls if c["name"] == "cublasCreate_v2")
    create["status"] = 3                                    # as if the GPU had failed to allocate
    bad = tmp_path / "changed.rgputrace"
    with gzip.open(bad, "wb") as f:
        for obj in (header, *calls, end):
            f.write(msgpack.packb(obj, use_bin_type=True))
    rep = trace.replay(bad)
    assert not rep["ok"]
    assert any(target["name"] in m for m in rep["value_mismatch"]), rep
    assert any("cublasCreate_v2: GPU 3" in m for m in rep["status_mismatch"]), rep


def test_operand_extents_follow_transposes_leading_dimensions_and_batches():
    from rgpu.server.cuda.libs import trace
    f = dict(transa=1, transb=0, m=3, n=4, k=5, lda=7, ldb=6, ldc=8, A=0x100, B=0x200, C=0x300, pointer_mode=0,
             alpha=b"\0" * 16, beta=b"\0" * 16)
    ins, outs = trace.operands("cublasSgemm_v2", f, b"")
    assert ins == [(0x100, 4 * (2 * 7 + 5)), (0x200, 4 * (3 * 6 + 5)), (0x300, 4 * (3 * 8 + 3))]
    assert outs == [(0x300, 4 * 27, "float32")]
    f.update(stride_a=200, stride_b=100, stride_c=40, batch=3)
    ins, _ = trace.operands("cublasSgemmStridedBatched", f, b"")
    assert ins[0] == (0x100, 4 * (2 * 7 + 5 + 2 * 200))
    assert trace.operands("cudnnBackendExecute", {}, b"") is None


def _committed():
    return sorted(TRACES.glob("*.rgputrace")) if TRACES.is_dir() else []


@pytest.mark.parametrize("path", _committed() or [None], ids=lambda p: p.name if p else "none")
def test_every_committed_gpu_trace_replays_within_tolerance(path):
    if path is None:
        pytest.skip("no GPU trace in tests/lib_traces/ yet (RECORD=1 bash gpu/check_cuda_libs.sh records them)")
    from rgpu.server.cuda.libs import trace
    rep = trace.replay(path)
    assert rep["flavour"] == "real" and rep["compared"] > 0, rep
    assert rep["ok"], {k: rep[k] for k in ("status_mismatch", "value_mismatch", "errors", "live_after_close")}


def test_a_trimmed_trace_keeps_every_call_but_the_large_computing_ones_and_still_replays(recorded, tmp_path):
    from rgpu.server.cuda.libs import trace
    path = max(recorded, key=lambda p: len(trace.load(p)[1]))
    small = tmp_path / "small.rgputrace"
    got = trace.trim(path, small, 64)
    _, calls, end = trace.load(small)
    assert got["kept"] == len(calls) < got["calls"] and end is not None
    assert all(sum(len(x[3]) for x in c.get("inputs", []) + c.get("outputs", [])) <= 64 for c in calls)
    assert trace.replay(small)["ok"]
