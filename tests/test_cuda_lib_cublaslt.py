"""rgpu's libcublasLt.so.13: descriptors kept in C, the heuristic cached by content, the matmul one queued record.

A C program (``lib_programs/cublaslt_matmul.c``, its own declarations) built with gcc against rgpu's
libraries runs through ``rgpu intercept run`` against ``rgpu serve --cuda-driver fake``; its printed values
are compared with numpy's computation of the same inputs. The server side is also driven directly
(malformed payloads, unknown handles, descriptors freed at close). On a GPU host the same program runs
natively against NVIDIA's libcublasLt and through rgpu against ``--cuda-driver real``.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import clean_env
from test_cuda_programs import run
from test_cuda_support import build_shim_or_skip

PROGRAM = Path(__file__).parent / "lib_programs" / "cublaslt_matmul.c"
MOCK = Path(__file__).parent / "lib_programs" / "cublaslt_mock.c"


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    build_shim_or_skip()
    from rgpu.cuda_intercept import libraries
    folder = libraries.build()
    exe = tmp_path_factory.mktemp("cublaslt") / "cublaslt_matmul"
    subprocess.run(["cc", "-std=gnu11", "-O1", "-Wall", str(PROGRAM), "-o", str(exe), f"-L{folder}",
                    "-l:libcublasLt.so.13", "-l:libcublas.so.13", "-l:libcuda.so.1"], check=True)
    return exe


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    from conftest import RunningServer
    server = RunningServer(tmp_path_factory.mktemp("rgpu-cublaslt-server"), ("--cuda-driver", "fake"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def through_rgpu(program, fake_server) -> subprocess.CompletedProcess:
    """One run of the program through rgpu against the fake server (each test reads its own lines)."""
    return run([program], fake_server)


def x(n: int, s: int) -> np.ndarray:
    i = np.arange(n)
    return ((i * s + 3) % 17 - 8) / 8.0


def parse(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in stdout.splitlines() if line.strip()}


def linear(m: int, n: int, k: int, act: str | None, bf16: bool) -> np.ndarray:
    """The program's linear(): y = act(x @ w^T + b), printed as column-major y^T, i.e. y row-major."""
    xs, w, b = (torch.tensor(v, dtype=torch.float32) for v in (x(n * k, 5).reshape(n, k), x(m * k, 7).reshape(m, k),
                                                              x(m, 3)))
    y = xs @ w.T + b
    y = torch.relu(y) if act == "relu" else torch.nn.functional.gelu(y, approximate="tanh") if act == "gelu" else y
    if bf16:
        y = y.to(torch.bfloat16).to(torch.float32)
    return y.numpy().reshape(-1)


def expected() -> dict[str, tuple[np.ndarray, float]]:
    """Label -> (values, relative tolerance)."""
    B, M, N, K = 3, 4, 5, 3
    a = x(B * M * K, 5).reshape(B, K, M).transpose(0, 2, 1)     # column-major per batch
    b = x(B * K * N, 7).reshape(B, N, K).transpose(0, 2, 1)
    c = x(B * M * N, 3).reshape(B, N, M).transpose(0, 2, 1)
    batched = (0.5 * a @ b + 2 * c).transpose(0, 2, 1).reshape(-1)
    m, n, k = 3, 2, 4
    a64 = x(k * m, 5).reshape(m, k)             # A is k x m column-major: A^T is m x k row-major
    b64 = x(n * k, 7).reshape(k, n)             # B is n x k column-major: B^T is k x n row-major
    c64 = x(m * n, 3).reshape(n, m).T
    fp64 = (1.5 * a64 @ b64 - c64).T.reshape(-1)
    return {"linear_fp32": (linear(6, 5, 7, None, False), 1e-6), "linear_bf16": (linear(8, 5, 8, None, True), 8e-3),
            "relu_bias_bf16": (linear(8, 3, 16, "relu", True), 8e-3),
            "gelu_bias_fp32": (linear(5, 4, 6, "gelu", False), 1e-3),     # a GPU's tanh is approximate
            "batched": (batched, 1e-6), "fp64": (fp64, 1e-12)}


def check_values(out: dict) -> None:
    for label, (want, rtol) in expected().items():
        got = np.array([float(v) for v in out[label]])
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=label)


def test_linear_batched_and_fp64_matmuls_print_numpys_values(through_rgpu):
    done = through_rgpu
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not supported over rgpu" not in done.stderr, done.stderr
    out = parse(done.stdout)
    check_values(out)
    assert out["done"] == []


def test_a_second_identical_heuristic_query_is_answered_from_the_cache(through_rgpu):
    done = through_rgpu
    assert done.returncode == 0, done.stdout + done.stderr
    # the fake's algo counts the session's heuristic answers: 4 linears came first, then 5, 5 (cached), 6
    got0, got1, got2, first, second, third, same = parse(done.stdout)["algo"]
    assert (got0, got1, got2) == ("1", "1", "1")
    assert (first, second, third, same) == ("5", "5", "6", "1")


def test_a_captured_matmul_replays_with_the_captures_scalars_over_the_replays_inputs(through_rgpu):
    # 3 * [[1, 3], [2, 4]] @ [[0, 1], [1, 0]] (column-major), not alpha's later 100 nor B's captured identity
    assert parse(through_rgpu.stdout)["captured"] == ["9", "12", "3", "6"], through_rgpu.stdout + through_rgpu.stderr


def test_a_cached_heuristic_is_answered_in_c_and_a_matmul_is_queued_not_waited_for(through_rgpu):
    heuristic, matmul = (float(v) for v in parse(through_rgpu.stdout)["per_call_us"])
    # a round trip costs tens of microseconds or more; these stay well under one
    assert heuristic < 5.0 and matmul < 20.0, through_rgpu.stdout


def test_the_descriptors_answer_get_in_c_with_cublaslts_size_rules(through_rgpu):
    done = through_rgpu
    # TRANSA back as set (4 bytes); EPILOGUE's size asked (4), its default DEFAULT (1); wrong sizes: INVALID_VALUE
    assert parse(done.stdout)["get"] == ["1", "4", "4", "1", "7", "7"], done.stdout + done.stderr


def test_an_unknown_handle_is_refused_now_when_answered_and_at_the_next_sync_when_queued(program, fake_server):
    done = run([program, "bogus"], fake_server)
    assert done.returncode == 0, done.stdout + done.stderr
    heur, mm, sync = parse(done.stdout)["bogus"]
    assert (heur, mm) == ("1", "0")            # CUBLAS_STATUS_NOT_INITIALIZED; queued: not known yet
    assert sync != "0"                         # the record's failure, deferred to the synchronisation
    assert "is not a cuBLAS or cuBLASLt handle of this session" in done.stderr, done.stderr


def test_the_c_side_and_the_protocol_module_agree_on_the_state_format():
    import re
    from rgpu.protocol import cuda_libs  # noqa: F401  (first: importing a library's module first is circular)
    from rgpu.protocol import lib_cublaslt as P
    c = (Path(__file__).parents[1] / "cuda_intercept" / "lib_cublaslt.c").read_text()
    assert "enum { KIND_NULL, KIND_DESC, KIND_LAYOUT, KIND_PREF };" in c
    assert (P.KIND_NULL, P.KIND_DESC, P.KIND_LAYOUT, P.KIND_PREF) == (0, 1, 2, 3)
    assert f"ALGO_BYTES = {P.ALGO}, RESULT_BYTES = {P.RESULT}" in c
    pointers = {int(a) for a in re.findall(r"\{KIND_DESC, (\d+), 8, 1, 0\}", c)}
    assert pointers == P.DESC_POINTERS            # keyed by alignment in C, zeroed in the server's key


# ---- the server side, driven directly ---------------------------------------------------------
def _objects(*objs) -> bytes:
    out = b""
    for kind, attrs in objs:
        body = b"".join(struct.pack("<II", a, len(v)) + v for a, v in sorted(attrs.items()))
        out += struct.pack("<II", kind, len(body)) + body
    return out


def _state(rows=2, bias=0):
    i32, u64 = (lambda v: struct.pack("<i", v)), (lambda v: struct.pack("<Q", v))
    desc = (1, {0: i32(68), 1: i32(0), **({8: u64(bias), 7: i32(4)} if bias else {})})
    layout = (2, {0: i32(0), 2: u64(rows), 3: u64(rows), 4: u64(rows)})
    return desc, layout


@pytest.fixture
def libs():
    from rgpu.server.cuda.fake import FakeDriver
    from rgpu.server.cuda.libs import Libraries
    driver = FakeDriver()
    driver.set_current(driver.primary_ctx_retain(0))
    libs = Libraries(driver)
    yield libs
    libs.close()


def _matmul_payload(libs, state: bytes, a: int) -> bytes:
    from rgpu.protocol.cuda_libs import BY_NAME
    fields = BY_NAME["cublasLtMatmul"].format
    return fields.pack(struct.pack("<f", 1.0).ljust(16, b"\0"), bytes(16), 0, 0, a, a, a, a, 0, 0, bytes(64), 0) + state


def test_malformed_payloads_and_unknown_handles_get_clear_errors(libs):
    from rgpu.protocol.cuda_libs import BY_NAME
    from rgpu.server.cuda.base import CudaDriverError
    call = BY_NAME["cublasLtMatmul"].id
    with pytest.raises(CudaDriverError, match="a payload of 3 bytes, expected at least"):
        libs.run(call, 1, 0, memoryview(b"abc"), answered=True)
    assert libs.run(BY_NAME["cublasLtCreate"].id, 7, 0, memoryview(bytes(8)), answered=True) == [0, None]
    desc, layout = _state()
    status, message = libs.run(call, 7, 0, memoryview(_matmul_payload(libs, _objects(desc, layout)[:-3], 0)),
                               answered=True)
    assert status == 7 and "past the state's end" in message
    status, message = libs.run(call, 99, 0, memoryview(_matmul_payload(libs, _objects(desc, *[layout] * 4), 0)),
                               answered=True)
    assert status == 1 and "handle 0x63 is not a cuBLAS or cuBLASLt handle" in message
    heur = BY_NAME["cublasLtMatmulAlgoGetHeuristic"]
    status, message = libs.run(heur.id, 7, 0, memoryview(heur.format.pack(1) + _objects(*[layout] * 6)),
                               answered=True)
    assert status == 7 and "object 0 is not a desc" in message
    with pytest.raises(CudaDriverError, match="cublasLtDestroy: .*was not created"):
        libs.run(BY_NAME["cublasLtDestroy"].id, 8, 0, memoryview(b"\0"), answered=False)


def test_mutated_payloads_get_a_status_or_a_driver_error_never_a_crash(libs):
    from rgpu.protocol.cuda_libs import BY_NAME
    from rgpu.server.cuda.base import CudaDriverError
    libs.run(BY_NAME["cublasLtCreate"].id, 7, 0, memoryview(bytes(8)), answered=True)
    mem = libs.driver.mem_alloc(256)
    desc, layout = _state(rows=2, bias=mem + 128)
    good = _matmul_payload(libs, _objects(desc, *[layout] * 4), mem)
    heur = BY_NAME["cublasLtMatmulAlgoGetHeuristic"]
    good_heur = heur.format.pack(1) + _objects(desc, *[layout] * 4, (3, {}))
    rng = np.random.default_rng(5)
    for i in range(400):
        call, payload = (BY_NAME["cublasLtMatmul"].id, good) if i % 2 else (heur.id, good_heur)
        data = bytearray(payload)
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(0, len(data))] = int(rng.integers(0, 256))
        data = data[:rng.integers(len(data) // 2, len(data) + 1)] if i % 3 == 0 else data
        try:
            reply = libs.run(call, 7, 0, memoryview(bytes(data)), answered=True)
        except CudaDriverError:
            continue
        assert isinstance(reply[-2], int) and (reply[-2] == 0) == (reply[-1] is None), reply


def test_descriptors_are_kept_by_content_bias_pointers_apart_and_freed_at_close(libs):
    from rgpu.protocol.cuda_libs import BY_NAME
    libs.run(BY_NAME["cublasLtCreate"].id, 7, 0, memoryview(bytes(8)), answered=True)
    mem = libs.driver.mem_alloc(64)
    libs.driver.memcpy_htod(mem, None, memoryview(np.arange(16, dtype=np.float32).tobytes()))
    for bias in (mem, mem + 32, mem):             # two bias pointers: one descriptor
        desc, layout = _state(rows=2, bias=bias)
        assert libs.run(BY_NAME["cublasLtMatmul"].id, 7, 0, memoryview(_matmul_payload(
            libs, _objects(desc, *[layout] * 4), mem)), answered=True) == [0, None]
    lt = libs.library("cublaslt")
    assert lt.live() == 3                        # the handle, one desc, one layout
    libs.close()
    assert lt.live() == 0


@pytest.fixture
def real_side(tmp_path, monkeypatch):
    """The server's ctypes side over a stand-in libcublasLt.so.13 (``cublaslt_mock.c``): (libraries, mock)."""
    lib = tmp_path / "libcublasLt.so.13"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcublasLt.so.13", str(MOCK), "-o", str(lib)],
                   check=True)
    monkeypatch.setenv("RGPU_CUDA_LIB_DIR", str(tmp_path))
    from rgpu.server.cuda.libs import Libraries

    class RealDriver:
        name = "real"
    libs = Libraries(RealDriver())
    yield libs, ctypes.CDLL(str(lib))
    libs.close()


def test_the_real_side_hands_cublaslt_the_state_scalars_pointers_and_stream_in_its_order(real_side):
    from rgpu.protocol.cuda_libs import BY_NAME
    libs, mock = real_side
    assert libs.run(BY_NAME["cublasLtCreate"].id, 7, 0, memoryview(bytes(8)), answered=True) == [0, None]
    a = np.asfortranarray(x(6, 5).reshape(2, 3), np.float32)        # m=2, k=3
    b = np.asfortranarray(x(6, 7).reshape(2, 3), np.float32)        # n=2, k=3, used transposed
    c = np.asfortranarray(x(4, 3).reshape(2, 2), np.float32)
    d = np.zeros((2, 2), np.float32, order="F")
    bias1, bias2, dev_scalars = (np.array(v, np.float32) for v in ([1, 2], [10, 20], [3, 0]))
    i32, u64 = (lambda v: struct.pack("<i", v)), (lambda v: struct.pack("<Q", v))
    lay = lambda r, k: (2, {0: i32(0), 2: u64(r), 3: u64(k), 4: u64(r)})            # noqa: E731
    matmul = BY_NAME["cublasLtMatmul"]

    def run_matmul(bias, mode=0, alpha=2.0, beta=0.5):
        desc = (1, {0: i32(68), 1: i32(0), 2: i32(mode), 4: i32(1), 7: i32(4), 8: u64(bias.ctypes.data)})
        host = mode == 0
        fields = matmul.format.pack(struct.pack("<f", alpha).ljust(16, b"\0") if host else bytes(16),
                                    struct.pack("<f", beta).ljust(16, b"\0") if host else bytes(16),
                                    0 if host else dev_scalars.ctypes.data, 0 if host else dev_scalars.ctypes.data + 4,
                                    a.ctypes.data, b.ctypes.data, c.ctypes.data, d.ctypes.data, 0xBEEF000, 4096,
                                    struct.pack("<Q", 0xA160).ljust(64, b"\0"), 1)
        state = _objects(desc, lay(2, 3), lay(2, 3), lay(2, 2), lay(2, 2))
        return libs.run(matmul.id, 7, 0x55, memoryview(fields + state), answered=True)

    assert run_matmul(bias1) == [0, None]
    np.testing.assert_allclose(d, 2 * a @ b.T + 0.5 * c + bias1[:, None], rtol=1e-6)
    assert (ctypes.c_uint64.in_dll(mock, "mock_stream").value, ctypes.c_uint64.in_dll(mock, "mock_workspace").value,
            ctypes.c_size_t.in_dll(mock, "mock_workspace_size").value,
            ctypes.c_uint64.in_dll(mock, "mock_algo0").value) == (0x55, 0xBEEF000, 4096, 0xA160)
    held = mock.mock_live()
    assert run_matmul(bias2) == [0, None]                   # another bias: the same real descriptor, re-pointed
    np.testing.assert_allclose(d, 2 * a @ b.T + 0.5 * c + bias2[:, None], rtol=1e-6)
    assert mock.mock_live() == held
    assert run_matmul(bias1, mode=1) == [0, None]           # device scalars: 3 and 0, read where they are
    np.testing.assert_allclose(d, 3 * a @ b.T + bias1[:, None], rtol=1e-6)
    heur = BY_NAME["cublasLtMatmulAlgoGetHeuristic"]
    pref = (3, {1: u64(1 << 20)})
    out, status, message = libs.run(heur.id, 7, 0, memoryview(heur.format.pack(4) + _objects(
        (1, {0: i32(68), 1: i32(0)}), lay(2, 3), lay(2, 3), lay(2, 2), lay(2, 2), pref)), answered=True)
    assert (status, len(out)) == (0, 96)
    algo0, algo1, workspace, state, waves = struct.unpack_from("<QQ48xQif", out)
    assert (algo0, algo1, workspace, state, waves) == (0xA160, 2, 0, 0, 1.0)
    assert ctypes.c_uint64.in_dll(mock, "mock_pref_workspace").value == 1 << 20
    status, message = libs.run(heur.id, 8, 0, memoryview(heur.format.pack(1) + _objects(*[lay(2, 2)] * 6)),
                               answered=True)
    assert status == 1 and "not a cuBLAS or cuBLASLt handle" in message
    libs.close()
    assert mock.mock_live() == 0                            # handle, descriptors, layouts, preference: all freed


def _nvidia_cublaslt() -> str:
    """NVIDIA's libcublasLt.so.13 where one is installed (its descriptors need no GPU), else skip."""
    from rgpu.server.cuda.libs import loading
    found = next((p for p in loading.candidates("libcublasLt.so.13") if os.sep in p and "rgpu" not in p), None)
    if found is None:
        pytest.skip("NVIDIA's libcublasLt.so.13 is not installed here (pip install nvidia-cublas, or RGPU_CUDA_LIB_DIR)")
    return found


def test_the_c_sides_attribute_sizes_and_defaults_are_nvidias():
    import re
    lib = ctypes.CDLL(_nvidia_cublaslt())
    c = (Path(__file__).parents[1] / "cuda_intercept" / "lib_cublaslt.c").read_text()
    table = re.findall(r"\{KIND_(DESC|LAYOUT|PREF), (\d+), (\d+), \d, ([^}]+)\}", c)
    made = {"DESC": ctypes.c_void_p(), "LAYOUT": ctypes.c_void_p(), "PREF": ctypes.c_void_p()}
    assert lib.cublasLtMatmulDescCreate(ctypes.byref(made["DESC"]), 68, 0) == 0
    assert lib.cublasLtMatrixLayoutCreate(ctypes.byref(made["LAYOUT"]), 0, ctypes.c_uint64(4), ctypes.c_uint64(5),
                                          ctypes.c_int64(4)) == 0
    assert lib.cublasLtMatmulPreferenceCreate(ctypes.byref(made["PREF"])) == 0
    get = {"DESC": lib.cublasLtMatmulDescGetAttribute, "LAYOUT": lib.cublasLtMatrixLayoutGetAttribute,
           "PREF": lib.cublasLtMatmulPreferenceGetAttribute}
    created = {("DESC", 0), ("DESC", 1), ("LAYOUT", 0), ("LAYOUT", 2), ("LAYOUT", 3), ("LAYOUT", 4)}
    defaults = {"(uint32_t)-1": 0xFFFFFFFF, "~(uint64_t)0": (1 << 64) - 1}
    for kind, attr, size, default in table:
        need, buf = ctypes.c_size_t(0), ctypes.create_string_buffer(16)
        assert get[kind](made[kind], int(attr), None, ctypes.c_size_t(0), ctypes.byref(need)) == 0, (kind, attr)
        assert need.value == int(size), (kind, attr)
        assert get[kind](made[kind], int(attr), buf, need, None) == 0
        if (kind, int(attr)) not in created:
            want = defaults.get(default.strip()) or int(default.strip(), 0)
            assert int.from_bytes(buf.raw[:need.value], "little") == want, (kind, attr)
    lib.cublasLtMatmulDescDestroy(made["DESC"])
    lib.cublasLtMatrixLayoutDestroy(made["LAYOUT"])
    lib.cublasLtMatmulPreferenceDestroy(made["PREF"])


def test_nvidias_library_takes_the_descriptors_as_torch_sets_them_and_all_are_freed(monkeypatch):
    found = _nvidia_cublaslt()
    monkeypatch.setenv("RGPU_CUDA_LIB_DIR", os.path.dirname(found))
    from rgpu.protocol import lib_cublaslt as P
    from rgpu.server.cuda.libs import Libraries

    class RealDriver:
        name = "real"
    libs = Libraries(RealDriver())
    lt = libs.library("cublaslt")
    i32, u64, i64 = (lambda v: struct.pack("<i", v)), (lambda v: struct.pack("<Q", v)), (lambda v: struct.pack("<q", v))
    # torch's addmm in bf16: TRANSA=T, EPILOGUE=BIAS and its pointer and type, SM_COUNT_TARGET, FAST_ACCUM (1 byte);
    # a batched layout; the preference's workspace, reduction mask and alignments
    state = [(1, {0: i32(68), 1: i32(0), 3: i32(1), 4: i32(0), 7: i32(4), 8: u64(0x7F0000001000), 26: i32(14),
                  15: i32(0), 25: b"\1"}),
             (2, {0: i32(14), 2: u64(8), 3: u64(5), 4: u64(8), 5: i32(3), 6: i64(40)}),
             (3, {1: u64(1 << 22), 3: i32(3), 5: i32(16), 6: i32(16), 7: i32(16), 8: i32(16)})]
    getters = {1: "cublasLtMatmulDescGetAttribute", 2: "cublasLtMatrixLayoutGetAttribute",
               3: "cublasLtMatmulPreferenceGetAttribute"}
    for obj, (kind, attrs) in zip(P.parse(_objects(*state), 3), state):
        real = lt._real(obj)
        for attr, value in attrs.items():
            buf = ctypes.create_string_buffer(len(value))
            get = getattr(lt._lib, getters[kind])
            assert get(ctypes.c_void_p(real), attr, buf, ctypes.c_size_t(len(value)), None) == 0, (kind, attr)
            assert buf.raw == value, (kind, attr)
    assert lt.live() == 3
    libs.close()
    assert lt.live() == 0


@pytest.mark.gpu
def test_the_program_prints_through_rgpu_what_it_prints_natively(program, start_server):
    from rgpu.server.cuda import real_api
    from rgpu.server.cuda.libs import loading
    if not real_api.candidates() or not shutil.which("nvidia-smi"):
        pytest.skip("needs an NVIDIA GPU and its driver (runs through the device tool, not in CI)")
    real = next((p for p in loading.candidates("libcublasLt.so.13") if os.sep in p), None)
    if real is None:
        pytest.skip("NVIDIA's libcublasLt.so.13 is not installed here (pip install nvidia-cublas)")
    native = subprocess.run([str(program)], capture_output=True, text=True, timeout=120,
                            env=clean_env(LD_LIBRARY_PATH=os.path.dirname(real)))
    assert native.returncode == 0, native.stdout + native.stderr
    done = run([program], start_server("--cuda-driver", "real"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ours, theirs = parse(done.stdout), parse(native.stdout)
    check_values(theirs)                                      # the program itself is right
    for label in expected():                                  # and rgpu runs what NVIDIA runs
        np.testing.assert_allclose(np.array(ours[label], float), np.array(theirs[label], float), rtol=1e-6,
                                   err_msg=label)
    assert ours["get"] == theirs["get"] and ours["captured"] == theirs["captured"]
    assert ours["algo"][:3] == theirs["algo"][:3] and ours["algo"][6] == "1"
