"""rgpu's libcublas.so.13 forwarding whole calls: a C program's GEMMs, GEMVs and dot products against numpy.

The program (``lib_programs/cublas_gemms.c``, its own declarations, built with gcc against rgpu's
libraries) runs through ``rgpu intercept run`` against ``rgpu serve --cuda-driver fake``, whose cuBLAS is
torch on the CPU; every buffer it prints, padding included, is compared with numpy's computation of the
same call. The server side is also driven directly (``Libraries``): handles freed at the session's end,
a short payload or an unknown handle answered with a clear error. On a GPU host (``-m gpu``) the same
program through rgpu against the real driver prints what it prints run natively.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import clean_env
from test_cuda_programs import run

HERE = Path(__file__).parent / "lib_programs"


def x_of(n: int, s: int) -> np.ndarray:
    return np.array([((i * s + 3) % 17 - 8) / 8.0 for i in range(n)])


def gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, oa=0, ob=0, oc=0):
    """c (a flat column-major buffer, changed in place) = alpha op(a) op(b) + beta c, as BLAS defines it."""
    def mat(buf, rows, cols, ld, off):
        return np.array([[buf[off + i + j * ld] for j in range(cols)] for i in range(rows)])
    A = mat(a, *((m, k) if ta == 0 else (k, m)), lda, oa)
    B = mat(b, *((k, n) if tb == 0 else (n, k)), ldb, ob)
    out = alpha * ((A if ta == 0 else A.T) @ (B if tb == 0 else B.T))
    if beta != 0:
        out = out + beta * mat(c, m, n, ldc, oc)
    for j in range(n):
        c[oc + j * ldc:oc + j * ldc + m] = out[:, j]
    return c


def bf16(v: np.ndarray) -> np.ndarray:
    import torch
    return torch.tensor(v, dtype=torch.float32).to(torch.bfloat16).to(torch.float64).numpy()


def expected() -> dict[str, np.ndarray]:
    """What cublas_gemms.c must print, label by label."""
    A, B, C = x_of(21, 3), x_of(18, 5), x_of(32, 7)
    out = {"sgemm_nt": gemm(0, 1, 5, 4, 3, 1.5, A, 7, B, 6, 0.5, C.copy(), 8)}
    out["sgemm_tn_device"] = gemm(1, 0, 3, 4, 5, -1.0, A, 7, x_of(20, 9), 5, 2.0, x_of(20, 11), 5)
    dA = x_of(16, 2)
    c = np.full(9, np.nan)
    out["dgemm_tt_beta0"] = gemm(1, 1, 2, 3, 4, 0.25, dA, 4, x_of(12, 4), 3, 0.0, c, 3)
    out["gemmex_bf16"] = bf16(gemm(0, 1, 4, 3, 5, 1.0, x_of(25, 6), 5, x_of(15, 8), 3, 1.0, x_of(18, 10), 6))
    sA, sB, sC = x_of(120, 12), x_of(33, 13), x_of(27, 14)
    for i in range(3):
        gemm(0, 0, 3, 2, 4, 2.0, sA, 3, sB, 5, -1.0, sC, 4, 40 * i, 11 * i, 9 * i)
    out["sgemm_strided"] = sC
    eB, eC = x_of(16, 15), x_of(8, 16)
    for i in range(2):
        gemm(1, 0, 2, 2, 3, 1.0, A, 7, eB, 4, 0.0, eC, 2, 0, 8 * i, 4 * i)
    out["gemm_strided_ex"] = eC
    gx, gy = x_of(6, 17), x_of(5, 18)
    a53 = np.array([[A[i + 7 * j] for j in range(3)] for i in range(5)])
    gy = 99.0 * a53 @ gx[::2][:3] + 0.5 * gy        # alpha was 99 when Sgemv ran: copied at each call
    out["sgemv_n"] = gy
    Dy = x_of(7, 20)
    a43 = np.array([[dA[i + 5 * j] for j in range(3)] for i in range(4)])
    Dy[::3] = -2.0 * a43.T @ x_of(5, 19)[:4] + Dy[::3]
    out["dgemv_t"] = Dy
    out["sdot_host"] = np.array([gx[::2][:3] @ gy[:3]])
    out["sdot_device"] = np.array([A[:5] @ gy])
    zA, zB, zC = (x_of(8, s).view(np.complex128) for s in (21, 22, 23))
    zc = zC.copy()
    gemm(2, 0, 2, 2, 2, 1 + 0.5j, zA.conj(), 2, zB, 2, 0.5 - 1j, zc, 2)   # op C: A's conjugate, transposed
    out["gemmex_complex"] = zc.view(np.float64)
    pA, pB, pC = x_of(16, 24), x_of(24, 25), x_of(18, 26)
    for i in range(2):
        gemm(0, 0, 2, 3, 4, 1.0, pA, 2, pB, 4, 1.0, pC, 3, 8 * i, 12 * i, 9 * i)
    out["gemm_batched_ex"] = pC
    out["sgemmex_bf16"] = gemm(0, 1, 4, 3, 5, 2.0, x_of(25, 6), 5, x_of(15, 8), 3, -1.0, x_of(12, 27), 4)
    qA, qC = x_of(14, 28), x_of(12, 30)
    for i in range(2):
        gemm(0, 1, 3, 2, 2, 0.5, qA, 4, x_of(8, 29), 2, 0.0, qC, 3, 7 * i, 4 * i, 6 * i)
    out["dgemm_strided"] = qC
    out["ddot_device"] = np.array([qA[::3][:4] @ qC[::2][:4]])
    out["dotex_host"] = np.array([pA[::2][:4] @ pB[:4]])
    out["sgemm_graph"] = gemm(0, 0, 2, 2, 2, 1.0, x_of(4, 32), 2, x_of(4, 32), 2, 0.0, x_of(4, 33), 2)
    return out


def parse(stdout: str) -> dict[str, np.ndarray]:
    return {f[0]: np.array([float(v) for v in f[1:]]) for f in (line.split() for line in stdout.splitlines())
            if len(f) > 1 and f[0] in expected.labels}


expected.labels = ("sgemm_nt", "sgemm_tn_device", "dgemm_tt_beta0", "gemmex_bf16", "sgemm_strided",
                   "gemm_strided_ex", "sgemv_n", "dgemv_t", "sdot_host", "sdot_device", "gemmex_complex",
                   "gemm_batched_ex", "sgemmex_bf16", "dgemm_strided", "ddot_device", "dotex_host", "sgemm_graph")


@pytest.fixture(scope="module")
def folder() -> Path:
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed (it builds the cuBLAS test program)")
    pytest.importorskip("cffi", reason="cffi builds libcuda.so.1")
    from rgpu.cuda_intercept import libraries
    return libraries.build()


def build(folder: Path, out: Path, libs: Path | None = None) -> Path:
    """cublas_gemms.c linked against rgpu's libraries (``folder``), or against ``libs`` (NVIDIA's)."""
    exe = out / "cublas_gemms"
    where = libs or folder
    cmd = ["gcc", "-O1", "-o", str(exe), str(HERE / "cublas_gemms.c"), f"-L{where}", "-l:libcudart.so.13",
           "-l:libcublas.so.13", f"-Wl,-rpath-link,{where}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return exe


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    from conftest import RunningServer
    server = RunningServer(tmp_path_factory.mktemp("rgpu-cublas-server"), ("--cuda-driver", "fake"))
    yield server
    server.stop()


def test_gemms_gemvs_and_dots_through_the_fake_server_equal_numpy(folder, fake_server, tmp_path):
    done = run([build(folder, tmp_path)], fake_server)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "version_major 13" in done.stdout and "done" in done.stdout, done.stdout + done.stderr
    assert "stream_kept 1 pointer_mode 1" in done.stdout and "math_mode 0" in done.stdout
    got, want = parse(done.stdout), expected()
    assert set(got) == set(want), done.stdout
    for label, values in want.items():
        np.testing.assert_allclose(got[label], values, rtol=1e-6, atol=1e-7, equal_nan=True, err_msg=label)


def test_a_refused_queued_gemm_fails_the_next_synchronisation_and_a_destroyed_handle_is_refused(folder, fake_server,
                                                                                              tmp_path):
    done = run([build(folder, tmp_path), "errors"], fake_server)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bad_lda queued=0 sync=1" in done.stdout, done.stdout + done.stderr
    assert "lda 1 is less than 4" in done.stderr, done.stderr
    assert "destroyed sgemm=1 version=1" in done.stdout          # CUBLAS_STATUS_NOT_INITIALIZED, on the client


# ---- the server side, driven directly ---------------------------------------------------------------

def _libraries():
    from rgpu.server.cuda.fake import FakeDriver
    from rgpu.server.cuda.libs import Libraries
    driver = FakeDriver()
    driver.set_current(driver.primary_ctx_retain(0))
    return driver, Libraries(driver)


def _sgemm_payload(spec, **over) -> bytes:
    f = {name: (b"\0" * int(code[:-1]) if code.endswith("s") else 0) for name, code in spec.fields}
    f.update(workspace_size=(1 << 64) - 1, m=1, n=1, k=1, lda=1, ldb=1, ldc=1)
    f.update(over)
    return spec.format.pack(*(f[name] for name, _ in spec.fields))


def test_every_handle_is_freed_when_the_session_ends():
    from rgpu.protocol.cuda_libs import BY_NAME
    driver, libs = _libraries()
    create = BY_NAME["cublasCreate_v2"]
    for h in (0x5247505500000001, 0x5247505500000002, 0x5247505500000003):
        out, status, _ = libs.run(create.id, h, 0, memoryview(struct.pack("<i", 130100)), answered=True)
        assert status == 0 and struct.unpack("<i", out)[0] // 10000 == 13
    libs.run(BY_NAME["cublasDestroy_v2"].id, 0x5247505500000002, 0, None, answered=False)
    cublas = libs.library("cublas")
    assert sorted(cublas.handles) == [0x5247505500000001, 0x5247505500000003]
    assert cublas.handle_for_lt(0x5247505500000001) is not None and cublas.handle_for_lt(0x99) is None
    libs.close()
    assert not cublas.handles


def test_a_short_payload_an_unknown_handle_and_a_wrong_major_version_are_clear_errors():
    from rgpu.protocol.cuda_libs import BY_NAME
    from rgpu.server.cuda.base import CudaDriverError
    driver, libs = _libraries()
    sgemm = BY_NAME["cublasSgemm_v2"]
    with pytest.raises(CudaDriverError, match="cublasSgemm_v2: a payload of 3 bytes"):
        libs.run(sgemm.id, 0x52475055000000aa, 0, memoryview(b"abc"), answered=False)
    status, message = libs.run(sgemm.id, 0x52475055000000aa, 0, memoryview(_sgemm_payload(sgemm)), answered=True)
    assert status == 1 and "0x52475055000000aa is not a cuBLAS handle of this session" in message
    with pytest.raises(CudaDriverError, match="not a cuBLAS handle"):
        libs.run(sgemm.id, 0x52475055000000aa, 0, memoryview(_sgemm_payload(sgemm)), answered=False)
    status, message = libs.run(BY_NAME["cublasCreate_v2"].id, 7, 0, memoryview(struct.pack("<i", 120900)),
                               answered=True)
    assert status == 1 and "major versions differ" in message
    libs.run(BY_NAME["cublasCreate_v2"].id, 8, 0, memoryview(struct.pack("<i", 130100)), answered=True)
    with pytest.raises(CudaDriverError, match="not inside one allocation"):   # a stray matrix pointer
        libs.run(sgemm.id, 8, 0, memoryview(_sgemm_payload(sgemm, A=0x1234)), answered=False)
    status, message = libs.run(sgemm.id, 8, 0, memoryview(_sgemm_payload(sgemm, transa=9)), answered=True)
    assert status == 7 and "transa 9" in message
    libs.close()


# ---- on a GPU host: the real library through rgpu equals the program run natively ------------------

def _real_lib_dir() -> Path:
    from rgpu.server.cuda.libs import loading
    for path in loading.candidates("libcublas.so.13"):
        if os.sep in path and Path(path).exists() and (Path(path).parent / "libcudart.so.13").exists():
            return Path(path).parent
    pytest.skip("no NVIDIA libcublas.so.13 beside a libcudart.so.13 (pip install nvidia-cublas nvidia-cuda-runtime)")


@pytest.mark.gpu
def test_the_program_through_rgpu_on_the_real_driver_prints_what_it_prints_natively(folder, tmp_path_factory):
    from conftest import RunningServer
    libs = _real_lib_dir()
    native_dir, ours_dir = tmp_path_factory.mktemp("native"), tmp_path_factory.mktemp("ours")
    native = subprocess.run([str(build(folder, native_dir, libs))], capture_output=True, text=True, timeout=120,
                            env=clean_env(LD_LIBRARY_PATH=str(libs)))
    assert native.returncode == 0, native.stdout + native.stderr
    server = RunningServer(tmp_path_factory.mktemp("rgpu-cublas-real"), ("--cuda-driver", "real"))
    try:
        done = run([build(folder, ours_dir)], server)
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == native.stdout                         # bitwise: the same real function, the same inputs
    got, want = parse(native.stdout), expected()
    for label, values in want.items():
        np.testing.assert_allclose(got[label], values, rtol=1e-6, atol=1e-7, equal_nan=True, err_msg=label)


# ---- the real implementation's ctypes calls, against a recording stand-in for NVIDIA's library --------

def _pack(spec, **over) -> memoryview:
    f = {name: (b"\0" * int(code[:-1]) if code.endswith("s") else 0) for name, code in spec.fields}
    f["workspace_size"] = (1 << 64) - 1
    f.update(over)
    return memoryview(spec.format.pack(*(f[name] for name, _ in spec.fields)))


def _scalar(code: str, value) -> bytes:
    return struct.pack("<" + code, value).ljust(16, b"\0")


def test_the_real_implementation_calls_the_same_functions_with_the_clients_arguments(tmp_path, monkeypatch):
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed (it builds the recording library)")
    import ctypes
    from rgpu.protocol.cuda_libs import BY_NAME
    from rgpu.server.cuda.libs import Libraries
    lib_path = tmp_path / "libcublas.so.13"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib_path), str(HERE / "cublas_recorder.c")], check=True)
    monkeypatch.setenv("RGPU_CUDA_LIB_DIR", str(tmp_path))
    recorder = ctypes.CDLL(str(lib_path))
    recorder.mock_log.restype = ctypes.c_char_p
    seen = [0]

    def new_lines() -> list[str]:
        text = recorder.mock_log().decode()
        lines, seen[0] = text[seen[0]:].splitlines(), len(text)
        return lines

    libs = Libraries(type("RealDriver", (), {"name": "real"})())
    call = lambda name, handle=0x52475055_00000001, stream=0, **f: libs.run(   # noqa: E731
        BY_NAME[name].id, handle, stream, _pack(BY_NAME[name], **f), answered=True)
    out, status, _ = call("cublasCreate_v2", client_version=130100)
    assert (status, struct.unpack("<i", out)[0], new_lines()) == (0, 131000, ["create"])
    gemm = dict(transa=0, transb=1, m=5, n=4, k=3, lda=7, ldb=6, ldc=8, A=0xA000, B=0xB000, C=0xC000,
                alpha=_scalar("f", 1.5), beta=_scalar("f", 0.5))
    state = dict(stream=0x1234, workspace=0xDEAD000, workspace_size=4096, math_mode=3)
    assert call("cublasSgemm_v2", **state, **gemm) == [0, None]
    assert new_lines() == ["stream 1234", "workspace dead000 4096", "math 3", "sgemm 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8"]
    call("cublasSgemm_v2", **state, **gemm)                       # nothing changed: no setter called again
    assert new_lines() == ["sgemm 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8"]
    status, message = call("cublasSgemm_v2", **dict(state, lda=2), **{k: v for k, v in gemm.items() if k != "lda"})
    assert status == 7 and "CUBLAS_STATUS_INVALID_VALUE" in message
    new_lines()
    device = dict(gemm, alpha=(0x5000).to_bytes(16, "little"), beta=(0x5008).to_bytes(16, "little"))
    call("cublasDgemm_v2", **state, pointer_mode=1, **device)
    assert new_lines() == ["pointer 1", "dgemm 0 1 5 4 3 20480 a000 7 b000 6 20488 c000 8"]
    ex = dict(gemm, atype=14, btype=14, ctype=14, compute_type=68, algo=-1)
    call("cublasGemmEx", **state, **ex)
    assert new_lines() == ["pointer 0", "gemmex 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8", "  types 14 14 14 68 -1"]
    strides = dict(stride_a=40, stride_b=11, stride_c=9, batch=3)
    call("cublasSgemmStridedBatched", **state, **gemm, **strides)
    call("cublasGemmStridedBatchedEx", **state, **ex, **strides)
    call("cublasGemmBatchedEx", **state, **ex, batch=2)
    call("cublasSgemmEx", **state, **{k: v for k, v in ex.items() if k not in ("compute_type", "algo")})
    dgemm = dict(gemm, alpha=_scalar("d", -2.0), beta=_scalar("d", 0.25))
    call("cublasDgemmStridedBatched", **state, **dgemm, **strides)
    assert new_lines() == ["sgemm_strided 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8", "  strides 40 11 9 3",
                           "gemm_strided_ex 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8",
                           "  types 14 14 14 68 -1 strides 40 11 9 3",
                           "gemm_batched_ex 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8", "  types 14 14 14 68 -1 batch 2",
                           "sgemmex 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8", "  types 14 14 14",
                           "dgemm_strided 0 1 5 4 3 -2 a000 7 b000 6 0.25 c000 8", "  strides 40 11 9 3"]
    gemv = dict(trans=1, m=4, n=3, lda=5, incx=2, incy=3, A=0xA000, x=0x1000, y=0x2000)
    call("cublasSgemv_v2", **state, **gemv, alpha=_scalar("f", 99.0), beta=_scalar("f", 0.5))
    call("cublasDgemv_v2", **state, **gemv, alpha=_scalar("d", -2.0), beta=_scalar("d", 1.0))
    assert new_lines() == ["sgemv 1 4 3 99 a000 5 1000 2 0.5 2000 3", "dgemv 1 4 3 -2 a000 5 1000 2 1 2000 3"]
    dot = dict(n=3, incx=2, incy=1, x=0x1000, y=0x2000, result=0x3000)
    assert call("cublasSdot_v2", **state, **dot) == [struct.pack("<f", 2.5), 0, None]
    assert call("cublasDdot_v2", **state, **dot) == [struct.pack("<d", -0.75), 0, None]
    assert call("cublasDotEx", **state, **dot, xtype=0, ytype=0, result_type=0, exec_type=0) == [
        struct.pack("<f", 4.0), 0, None]
    assert new_lines() == ["sdot 3 1000 2 2000 1", "ddot 3 1000 2 2000 1", "dotex 3 1000 0 2 2000 0 1 0 0"]
    # a new stream resets the real workspace to the library's pool, as the client's record does
    call("cublasSgemm_v2", stream=0x77, math_mode=3, **gemm)
    assert new_lines() == ["stream 77", "sgemm 0 1 5 4 3 1.5 a000 7 b000 6 0.5 c000 8"]
    call("cublasCreate_v2", handle=0x52475055_00000002, client_version=130100)
    assert libs.library("cublas").handle_for_lt(0x52475055_00000002) is not None
    assert libs.run(BY_NAME["cublasDestroy_v2"].id, 0x52475055_00000001, 0, None, answered=True) == [0, None]
    libs.close()                                                   # the second handle, destroyed at the end
    assert new_lines() == ["create", "destroy", "destroy"]
