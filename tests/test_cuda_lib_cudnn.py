"""rgpu's libcudnn.so.9: the backend graph API and legacy BN forwarded whole, checked against torch's arithmetic.

The C program (``lib_programs/cudnn_conv_bn.c``: its own prototypes, linked against rgpu's libraries)
builds a convolution graph the way cudnn-frontend does and runs BN through the legacy calls; it runs
through ``rgpu intercept run`` against ``rgpu serve --cuda-driver fake`` (torch on the CPU) and its
printed values are compared with torch's here. The server side is also driven directly: descriptor
bookkeeping, attribute checks, the counts back to zero, malformed payloads; its ctypes side over a
recording stand-in for the real library (``cudnn_mock.c``); the client library alone with a program as
its door (``cudnn_door.c``). On a GPU host
(``-m gpu``) the same program runs through rgpu against the real cuDNN and natively, and must agree.
"""
from __future__ import annotations

import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import clean_env
from cuda_programs import parse
from test_cuda_programs import run
from test_cuda_support import build_shim_or_skip

from rgpu.protocol.cuda_libs import BY_NAME
from rgpu.protocol.lib_cudnn import WIDTH, undump
from rgpu.server.cuda.base import CudaDriverError
from rgpu.server.cuda.fake import FakeDriver
from rgpu.server.cuda.libs import Libraries

PROGRAM = Path(__file__).parent / "lib_programs" / "cudnn_conv_bn.c"
F32 = np.float32


# ---- what the program must print, computed with torch ------------------------------------------
def _seq(n, mul, mod, scale, shift):
    return (np.arange(n) * mul % mod).astype(F32) * F32(scale) - F32(shift)


def expected() -> dict[str, np.ndarray]:
    t = lambda a, shape: torch.from_numpy(a.astype(np.float64)).reshape(shape)   # noqa: E731
    x = t(_seq(2 * 3 * 49, 7, 13, 0.25, 1.5), (2, 3, 7, 7))
    w = t(_seq(4 * 27, 5, 11, 0.125, 0.5), (4, 3, 3, 3))
    dy = t(_seq(2 * 4 * 20, 3, 7, 0.5, 1.0), (2, 4, 4, 5))
    conv = dict(stride=(2, 1), padding=(1, 1), dilation=(1, 2))
    y = F.conv2d(x, w, **conv)
    dx = torch.nn.grad.conv2d_input(x.shape, w, dy, **conv) * 0.5
    dw = torch.nn.grad.conv2d_weight(x, w.shape, dy, **conv)
    out = {"conv_y": y, "conv_dx": dx, "conv_dw": dw}
    bx = t(_seq(300, 7, 19, 0.2, 1.5), (4, 3, 5, 5)).requires_grad_()
    bdy = t(_seq(300, 11, 17, 0.1, 0.8), (4, 3, 5, 5))
    scale = torch.tensor([1.0 + 0.5 * c for c in range(3)], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([np.float32(0.1) * c - np.float32(0.2) for c in range(3)], dtype=torch.float64, requires_grad=True)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    by = F.batch_norm(bx, rm, rv, scale, bias, training=True, momentum=0.1, eps=1e-5)
    by.backward(bdy)
    mean = bx.detach().mean((0, 2, 3))
    inv = (bx.detach().var((0, 2, 3), unbiased=False) + 1e-5).rsqrt()
    infer = F.batch_norm(bx.detach(), rm, rv, scale.detach(), bias.detach(), training=False, eps=1e-5)
    out.update(bn_y=by, bn_save_mean=mean, bn_save_inv_var=inv, bn_running_mean=rm, bn_running_var=rv,
               bn_dx=bx.grad, bn_dscale=scale.grad, bn_dbias=bias.grad, bn_infer_y=infer)
    out = {k: v.detach().numpy().astype(F32).astype(np.float64).ravel() for k, v in out.items()}
    out["bn_desc"] = np.array([0, 4, 1, 3, 1, 1], dtype=np.float64)
    out["stream"] = np.array([1.0])
    out["version"] = np.array([9.0])
    return out


def check(stdout: str, rtol: float = 2e-6, atol: float = 2e-5) -> None:
    got, want = parse(stdout), expected()
    for label, values in want.items():
        assert label in got, f"no {label!r} line in the output:\n{stdout[-2000:]}"
        np.testing.assert_allclose(got[label], values, rtol=rtol, atol=atol, err_msg=label)
    for kind in range(3):
        assert got[f"conv{kind}_plan"].tolist() == [1, 1, 1]


# ---- building and running -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def libraries() -> Path:
    build_shim_or_skip()
    from rgpu.cuda_intercept import libraries
    return libraries.build()


def compile_program(out: Path, lib_dirs: list[Path], libs: list[str]) -> Path:
    exe = out / "cudnn_conv_bn"
    cmd = ["cc", "-std=gnu11", "-O1", "-Wall", str(PROGRAM), "-o", str(exe)]
    for d in lib_dirs:
        cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
    subprocess.run(cmd + [f"-l:{lib}" for lib in libs], check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    from conftest import RunningServer
    # debug logging: the fake cuDNN says at the session's end what reached it and what was left
    server = RunningServer(tmp_path_factory.mktemp("rgpu-cudnn-server"), ("--cuda-driver", "fake"),
                           env={"RGPU_DEBUG": "1"})
    yield server
    server.stop()


def test_a_conv_graph_and_batch_norm_through_rgpu_give_torchs_values(libraries, fake_server, tmp_path):
    exe = compile_program(tmp_path, [libraries], ["libcudnn.so.9", "libcudart.so.13"])
    done = run([exe], fake_server)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "not supported over rgpu" not in done.stderr, done.stderr
    assert "done" in done.stdout.split()
    check(done.stdout)
    # per graph two Gets reach the server (the heuristic's results, the config's engine: both fill the
    # caller's descriptors); every other Get is answered from what the Finalize replies carried
    deadline = time.monotonic() + 15
    while "cuDNN: " not in fake_server.stderr and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next((x for x in fake_server.stderr.splitlines() if "cuDNN: " in x), "")
    assert "24 Finalize and 6 GetAttribute calls reached the server" in line, line or fake_server.stderr[-3000:]
    assert "left 0 handles, 0 backend and 0 tensor descriptors" in line, line


@pytest.mark.gpu
def test_on_a_gpu_the_program_through_rgpu_matches_its_native_run(libraries, start_server, tmp_path):
    from rgpu.server.cuda import real_api
    from rgpu.server.cuda.libs.loading import candidates
    if not real_api.candidates():
        pytest.skip("needs an NVIDIA GPU and its driver (runs through the device tool, not in CI)")
    real = {}
    for soname in ("libcudnn.so.9", "libcudart.so.13"):
        found = [p for p in candidates(soname) if "/" in p]
        if not found:
            pytest.skip(f"no real {soname} on this host")
        real[soname] = Path(found[0])
    native_dir = tmp_path / "native"
    native_dir.mkdir()
    native = compile_program(native_dir, sorted({p.parent for p in real.values()}), list(real))
    mine = compile_program(tmp_path, [libraries], ["libcudnn.so.9", "libcudart.so.13"])
    dirs = ":".join(sorted({str(p.parent) for p in real.values()}))
    here = subprocess.run([native], capture_output=True, text=True, timeout=120, env=clean_env(LD_LIBRARY_PATH=dirs))
    assert here.returncode == 0, here.stdout + here.stderr
    server = start_server("--cuda-driver", "real")
    done = run([mine], server)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    check(here.stdout, rtol=1e-2, atol=1e-2)          # an engine may use TF32 for fp32 data
    theirs, ours = parse(here.stdout), parse(done.stdout)
    assert theirs.keys() == ours.keys()
    for label, values in theirs.items():   # the same library and engine; a filter gradient may sum in any order
        np.testing.assert_allclose(ours[label], values, rtol=1e-5, atol=1e-5, err_msg=label)


def test_the_client_answers_gets_from_a_finalize_reply_and_carries_a_by_value_tensors_bytes(tmp_path):
    from rgpu.cuda_intercept import stubs
    lib = stubs.build("libcudnn.so.9", tmp_path / "lib")
    exe = tmp_path / "cudnn_door"
    subprocess.run(["cc", "-std=gnu11", "-O1", "-rdynamic", str(PROGRAM.parent / "cudnn_door.c"), "-o", str(exe),
                    f"-L{lib.parent}", "-l:libcudnn.so.9", f"-Wl,-rpath,{lib.parent}"], check=True, capture_output=True)
    done = subprocess.run([exe], capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "create_calls 1", "workspace 1 4096", "config_count 1", "answered_here 1",
        "counts 0 3 0 2 11 12 -5 0 0 0 1",              # NULL array: the total; else what was written (0 for 0)
        "asked 0 5 0 0 3 3 7 0",                        # a count query asks for none; then as many as asked
        "desc_as_id 1",
        "pack_finalize_queued 1 313",                   # a variant pack's Finalize is queued
        "execute 308 40 9 4 0.125",                     # plan and pack ids, then uid 9's 4 bytes, padded
        "unreadable 2000 0",                            # a by-value pointer that is not host memory: refused
        "calls 4 queued 8",                             # the two Gets above asked the server
        "handle_here 1 1",                              # a HANDLE attribute set here is answered here
        "sizes 101 101 101 102 asked 3"]                # new descriptors, the same contents: asked once
    assert "cudnnBackendExecute: a by-value tensor's pointer is not readable host memory" in done.stderr, done.stderr


# ---- the server side, driven directly -----------------------------------------------------------
class Session:
    """Libraries over a fake driver, called as the executor calls them (payloads packed by the protocol)."""

    def __init__(self):
        self.driver = FakeDriver()
        self.driver.set_current(self.driver.primary_ctx_retain(0))
        self.libs = Libraries(self.driver)
        self.next = 0x52475055 << 32

    def mint(self) -> int:
        self.next += 1
        return self.next

    def __call__(self, call, handle=0, tail=b"", queued=False, **fields):
        spec = BY_NAME[call]
        payload = spec.format.pack(*(fields[f] for f, _ in spec.fields)) + bytes(tail)
        return self.libs.run(spec.id, handle, 0, memoryview(payload), answered=not queued)

    @property
    def lib(self):
        return self.libs.library("cudnn")


def _ok(reply):
    assert reply[-2] == 0, reply
    return reply[0] if len(reply) == 3 else None


def _tensor(s, uid, dims):
    t = s.mint()
    strides = [int(np.prod(dims[i + 1:])) for i in range(len(dims))]
    _ok(s("cudnnBackendCreateDescriptor", t, type=17))
    for name, type_, data in ((901, 1, struct.pack("<i", 0)), (902, 3, struct.pack(f"<{len(dims)}q", *dims)),
                              (903, 3, struct.pack(f"<{len(dims)}q", *strides)), (906, 3, struct.pack("<q", uid)),
                              (900, 3, struct.pack("<q", 16)), (907, 2, b"\0")):
        _ok(s("cudnnBackendSetAttribute", t, data, name=name, type=type_, count=len(data) // WIDTH[type_]))
    return t


def test_descriptors_are_checked_kept_and_all_freed_at_session_end():
    s = Session()
    h = s.mint()
    _ok(s("cudnnCreate", h, client_version=91900))
    x = _tensor(s, 1, [1, 2, 3, 3])
    # a wrong element type and a wrong element count are the library's errors, not a crash
    bad = s("cudnnBackendSetAttribute", x, struct.pack("<i", 0), name=906, type=23, count=1)
    assert bad[0] == 2010 and "element type" in bad[1]
    short = s("cudnnBackendSetAttribute", x, b"\0" * 12, name=902, type=3, count=2)
    assert short[0] == 2000 and "12 bytes for 2 elements" in short[1]
    dump = _ok(s("cudnnBackendFinalize", x))
    entries = {name: (count, data) for name, _, count, data in undump(dump)}
    assert entries[902] == (4, struct.pack("<4q", 1, 2, 3, 3)) and entries[906][1] == struct.pack("<q", 1)
    got = _ok(s("cudnnBackendGetAttribute", x, name=902, type=3, requested=2))
    assert struct.unpack("<q2q", got) == (4, 1, 2)
    assert s.lib.counts() == (1, 1, 0)
    _ok(s("cudnnBackendDestroyDescriptor", x))
    t = s.mint()
    _ok(s("cudnnCreateTensorDescriptor", t))
    _ok(s("cudnnSetTensorNdDescriptor", t, struct.pack("<8i", 1, 2, 3, 3, 18, 9, 3, 1), dtype=0, nbdims=4))
    assert s.lib.counts() == (1, 0, 1)
    _ok(s("cudnnDestroyTensorDescriptor", t))
    _ok(s("cudnnDestroy", h))
    assert s.lib.counts() == (0, 0, 0)
    # what a program leaves behind is freed when the session ends
    _ok(s("cudnnCreate", h, client_version=91900))
    _tensor(s, 2, [1, 1, 1, 1])
    lib = s.lib
    assert lib.counts() == (1, 1, 0)
    s.libs.close()
    assert lib.counts() == (0, 0, 0)


def test_a_short_payload_or_an_unknown_descriptor_is_a_clear_error():
    s = Session()
    spec = BY_NAME["cudnnBackendSetAttribute"]
    with pytest.raises(CudaDriverError, match="a payload of 3 bytes, expected at least 16"):
        s.libs.run(spec.id, 1, 0, memoryview(b"abc"), answered=True)
    reply = s("cudnnBackendFinalize", 0xDEAD)
    assert reply[0] == 2000 and "0xdead is not a backend descriptor of this session" in reply[1]
    # a queued call's failure is raised for the executor to defer, naming the call
    with pytest.raises(CudaDriverError, match="cudnnBackendExecute: .*not a cuDNN handle"):
        s("cudnnBackendExecute", 0xBEEF, queued=True, plan=1, pack=2)
    d = s.mint()
    _ok(s("cudnnBackendCreateDescriptor", d, type=15))
    ids = struct.pack("<Q", 0x1234)
    reply = s("cudnnBackendSetAttribute", d, ids, name=801, type=15, count=1)
    assert reply[0] == 2000 and "0x1234 is not a backend descriptor" in reply[1]
    bad = s("cudnnSetTensorNdDescriptor", 0x99, b"\0" * 4, dtype=0, nbdims=1)
    assert bad[0] == 2000


def test_the_servers_trace_names_each_call_with_its_status(monkeypatch, capsys):
    monkeypatch.setenv("RGPU_CUDA_LIB_TRACE", "1")
    s = Session()
    d = s.mint()
    _ok(s("cudnnBackendCreateDescriptor", d, type=15, queued=False))
    s("cudnnBackendFinalize", 0xDEAD)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"rgpu lib: cudnnBackendCreateDescriptor answered h={d:#x} type=15 +0B -> 0"), lines
    assert lines[1].startswith("rgpu lib: cudnnBackendFinalize answered h=0xdead  +0B -> 2000: "), lines
    monkeypatch.delenv("RGPU_CUDA_LIB_TRACE")
    Session()("cudnnBackendFinalize", 0xDEAD)
    assert not capsys.readouterr().err               # off by default


def test_a_plans_by_value_tensors_are_found_and_their_bytes_replace_the_host_pointers():
    import ctypes

    from rgpu.protocol.lib_cudnn import BY_VALUE, PATCH
    from rgpu.server.cuda.libs import LibError
    from rgpu.server.cuda.libs.cudnn_real import ByValue
    b, q, ids = ByValue(), (lambda *v: struct.pack(f"<{len(v)}q", *v)), (lambda *v: struct.pack(f"<{len(v)}Q", *v))
    for t, uid, by_value in ((1, 7, b"\1"), (2, 8, b"\0")):       # an attention scale by value, a device tensor
        for name, type_, data in ((906, 3, q(uid)), (901, 1, struct.pack("<i", 0)), (902, 3, q(1, 1, 1, 1)), (908, 2, by_value)):
            b.set(t, name, type_, len(data) // WIDTH[type_], data)
        b.finalized(t)
    b.set(3, 751, 15, 1, ids(2))
    b.set(3, 752, 15, 1, ids(1))
    b.finalized(3)                                  # the op
    b.forget(1)                                     # a tensor destroyed early takes nothing with it
    for desc, name, ref in ((4, 801, 3), (5, 201, 4)):    # the graph, the heuristic
        b.set(desc, name, 15, 1, ids(ref))
        b.finalized(desc)
    b.filled(6, 5)                                  # an engine config from the heuristic's results
    b.set(7, 401, 15, 1, ids(6))
    b.finalized(7)                                  # the plan
    assert b.entry(7) == [(BY_VALUE, 3, 2, q(7, 4))]
    b.set(9, 1000, 3, 2, q(8, 7))
    b.set(9, 1001, 6, 2, ids(0x7F0000001000, 0x1234))    # the scale's pointer: a host address of the client
    attrs, keep = b.patched(7, 9, PATCH.pack(7, 4) + struct.pack("<f", 0.125) + b"\0" * 4)
    ptrs = struct.unpack("<2Q", attrs[1001][2])
    assert ptrs[0] == 0x7F0000001000 and ptrs[1] == ctypes.addressof(keep[0])
    assert ctypes.string_at(ptrs[1], 4) == struct.pack("<f", 0.125)
    with pytest.raises(LibError, match="by-value tensor 99"):
        b.patched(7, 9, PATCH.pack(99, 4) + b"\0" * 8)
    with pytest.raises(LibError, match=r"by-value tensor\(s\) \[7\] came without their bytes"):
        b.patched(7, 9, b"")                        # the client's host address is never handed to the library


# ---- the real library's side, over a recording stand-in for libcudnn.so.9 ------------------------
@pytest.fixture
def mock_cudnn(tmp_path, monkeypatch):
    """``cudnn_real`` over ``lib_programs/cudnn_mock.c`` (found through RGPU_CUDA_LIB_DIR), and the mock itself."""
    import ctypes
    lib = tmp_path / "libcudnn.so.9"
    subprocess.run(["cc", "-std=gnu11", "-O1", "-shared", "-fPIC", str(PROGRAM.parent / "cudnn_mock.c"), "-o", str(lib)],
                   check=True, capture_output=True)
    monkeypatch.setenv("RGPU_CUDA_LIB_DIR", str(tmp_path))
    mock = ctypes.CDLL(str(lib))
    mock.mock_last.restype = ctypes.c_uint64
    mock.mock_last_d.restype = ctypes.c_double
    mock.mock_tensor.restype = ctypes.POINTER(ctypes.c_int)
    s = Session()
    s.libs = Libraries(type("RealDriver", (), {"name": "real"})())
    yield s, mock


def test_the_real_side_maps_ids_to_its_pointers_fills_the_callers_descriptors_and_passes_each_argument(mock_cudnn):
    s, mock = mock_cudnn
    h = s.mint()
    _ok(s("cudnnCreate", h, client_version=91900))
    real = s.lib
    assert real.handles[h][0].value and mock.mock_live() == 1
    heur, cfgs, plan, pack = s.mint(), [s.mint(), s.mint()], s.mint(), s.mint()
    for d, t in ((heur, 4), (cfgs[0], 3), (cfgs[1], 3), (plan, 5), (pack, 16)):
        _ok(s("cudnnBackendCreateDescriptor", d, type=t))
    early = s("cudnnBackendGetAttribute", heur, name=202, type=15, requested=0)    # the library's own refusal
    assert early[0] == 2004 and early[1].startswith("MOCK_ERROR (2004)"), early
    dump = {e[0]: e for e in undump(_ok(s("cudnnBackendFinalize", heur)))}
    assert dump[202][2:] == (2, None)                       # the results' count, for a count query answered locally
    got = _ok(s("cudnnBackendGetAttribute", heur, struct.pack("<2Q", *cfgs), name=202, type=15, requested=2))
    count, = struct.unpack_from("<q", got)
    filled, pos = [], 8
    for _ in range(count):                                   # each filled config's readable attributes
        n, = struct.unpack_from("<I", got, pos)
        filled.append({e[0]: e for e in undump(got[pos + 4:pos + 4 + n])})
        pos += 4 + n
    assert [f[303][3] for f in filled] == [struct.pack("<q", 1000), struct.pack("<q", 1001)]
    _ok(s("cudnnBackendSetAttribute", plan, struct.pack("<Q", h), name=400, type=0, count=1))
    _ok(s("cudnnBackendSetAttribute", plan, struct.pack("<Q", cfgs[1]), name=401, type=15, count=1))
    plan_dump = {e[0]: e for e in undump(_ok(s("cudnnBackendFinalize", plan)))}
    assert plan_dump[402][3] == struct.pack("<q", 4096) and plan_dump[401][2:] == (1, None)
    # the plan's handle attribute holds the real handle; asked back, it is the client's id again
    assert struct.unpack("<qQ", _ok(s("cudnnBackendGetAttribute", plan, name=400, type=0, requested=1))) == (1, h)
    _ok(s("cudnnBackendSetAttribute", pack, struct.pack("<2q", 1, 2), name=1000, type=3, count=2))
    _ok(s("cudnnBackendSetAttribute", pack, struct.pack("<2Q", 0x7F0000001000, 0xABC0), name=1001, type=6, count=2))
    assert s("cudnnBackendFinalizeQueued", pack, queued=True) is None
    for stream in (0x55, 0x55, 0x66):                        # the stream is set when it changes only
        assert s.libs.run(BY_NAME["cudnnBackendExecute"].id, h, stream, memoryview(struct.pack("<QQ", plan, pack)),
                          answered=False) is None
    assert mock.mock_stream_sets() == 2 and mock.mock_last(3) == 0x66
    assert (mock.mock_last(0), mock.mock_last(1), mock.mock_last(2)) == (
        real.handles[h][0].value, real.descs[plan][0].value, real.descs[pack][0].value)
    assert (mock.mock_last(4), mock.mock_last(5)) == (0x7F0000001000, 0xABC0)     # device addresses pass through

    # legacy BN: every argument where the real prototype has it, alpha/beta at the data type's width
    x, bn = s.mint(), s.mint()
    _ok(s("cudnnCreateTensorDescriptor", x))
    _ok(s("cudnnCreateTensorDescriptor", bn))
    _ok(s("cudnnSetTensorNdDescriptor", x, struct.pack("<8i", 2, 3, 4, 5, 60, 20, 5, 1), dtype=0, nbdims=4))
    assert list(mock.mock_tensor(real.tensors[x][0])[:6]) == [0, 4, 2060, 3020, 4005, 5001]
    _ok(s("cudnnDeriveBNTensorDescriptor", bn, x=x, mode=1))
    ws = _ok(s("cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize", h, mode=1, ops=0, x=x, z=0, y=x, bn=bn, act=0))
    assert struct.unpack("<Q", ws) == (101,)
    f = dict(mode=1, ops=0, alpha=1.5, beta=0.25, x=x, x_data=0x1000, z=0, z_data=0, y=x, y_data=0x2000, bn=bn,
             scale=0x3000, bias=0x4000, factor=0.1, running_mean=0x5000, running_var=0x6000, epsilon=1e-5,
             save_mean=0x7000, save_inv_var=0x8000, act=0, workspace=0x9000, workspace_size=77, reserve=0xA000,
             reserve_size=88)
    assert s("cudnnBatchNormalizationForwardTrainingEx", h, queued=True, **f) is None
    ints = [mock.mock_last(i) for i in range(21)]
    rx, rbn = real.tensors[x][0].value, real.tensors[bn][0].value
    assert ints == [real.handles[h][0].value, rx, 0x1000, 0, 0, rx, 0x2000, rbn, 0x3000, 0x4000, 0x5000, 0x6000,
                    0x7000, 0x8000, 0, 0x9000, 77, 0xA000, 88, 1, 0]
    assert [mock.mock_last_d(i) for i in range(4)] == [1.5, 0.25, 0.1, 1e-5]
    for d in (x, bn):
        _ok(s("cudnnDestroyTensorDescriptor", d))
    s.libs.close()                                           # what the session left is destroyed for real
    assert mock.mock_live() == 0


def test_the_real_side_hands_a_by_value_tensors_bytes_to_the_library(mock_cudnn):
    s, mock = mock_cudnn
    from rgpu.protocol.lib_cudnn import PATCH
    h, t, op, plan, pack = (s.mint() for _ in range(5))
    _ok(s("cudnnCreate", h, client_version=91900))
    _ok(s("cudnnBackendCreateDescriptor", t, type=17))
    for name, type_, data in ((906, 3, struct.pack("<q", 9)), (901, 1, struct.pack("<i", 0)),
                              (902, 3, struct.pack("<4q", 1, 1, 1, 1)), (908, 2, b"\1")):
        _ok(s("cudnnBackendSetAttribute", t, data, name=name, type=type_, count=len(data) // WIDTH[type_]))
    _ok(s("cudnnBackendFinalize", t))
    _ok(s("cudnnBackendCreateDescriptor", op, type=13))
    _ok(s("cudnnBackendSetAttribute", op, struct.pack("<Q", t), name=752, type=15, count=1))
    _ok(s("cudnnBackendFinalize", op))
    _ok(s("cudnnBackendCreateDescriptor", plan, type=5))
    _ok(s("cudnnBackendSetAttribute", plan, struct.pack("<Q", op), name=401, type=15, count=1))
    entries = {e[0]: e for e in undump(_ok(s("cudnnBackendFinalize", plan)))}
    assert entries[-1][2:] == (2, struct.pack("<2q", 9, 4))      # the plan's by-value tensor: uid 9, 4 bytes
    _ok(s("cudnnBackendCreateDescriptor", pack, type=16))
    _ok(s("cudnnBackendSetAttribute", pack, struct.pack("<2q", 3, 9), name=1000, type=3, count=2))
    _ok(s("cudnnBackendSetAttribute", pack, struct.pack("<2Q", 0x7F0000002000, 0x1234), name=1001, type=6, count=2))
    s("cudnnBackendFinalizeQueued", pack, queued=True)
    mock.mock_read(0b10)
    tail = PATCH.pack(9, 4) + struct.pack("<f", 0.125) + b"\0" * 4
    s.libs.run(BY_NAME["cudnnBackendExecute"].id, h, 0, memoryview(struct.pack("<QQ", plan, pack) + tail), answered=False)
    assert mock.mock_last(4) == 0x7F0000002000 and mock.mock_last(5) != 0x1234    # not the client's address
    assert mock.mock_last_d(1) == 0.125 and mock.mock_last(2) != s.lib.descs[pack][0].value   # a pack rebuilt for it
    live = mock.mock_live()
    s.libs.close()
    assert live == 5 and mock.mock_live() == 0         # the rebuilt pack went at once


def _nvidia_cudnn() -> str:
    """NVIDIA's libcudnn.so.9 where one is installed (a tensor descriptor needs no GPU), else skip."""
    from rgpu.server.cuda.libs import loading
    found = next((p for p in loading.candidates("libcudnn.so.9") if "/" in p and "rgpu" not in p), None)
    if found is None:
        pytest.skip("NVIDIA's libcudnn.so.9 is not installed here (pip install nvidia-cudnn-cu13, or RGPU_CUDA_LIB_DIR)")
    return found


def test_nvidias_counts_are_the_clients_and_the_real_side_keeps_every_element(monkeypatch):
    import ctypes
    found = _nvidia_cudnn()
    lib = ctypes.CDLL(found)
    lib.cudnnBackendSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
    lib.cudnnBackendGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                             ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p]
    t = ctypes.c_void_p()
    assert lib.cudnnBackendCreateDescriptor(17, ctypes.byref(t)) == 0
    dims = (2, 3, 4, 5)
    for name, type_, data in ((901, 1, struct.pack("<i", 0)), (902, 3, struct.pack("<4q", *dims)),
                              (903, 3, struct.pack("<4q", 60, 20, 5, 1)), (906, 3, struct.pack("<q", 7)),
                              (900, 3, struct.pack("<q", 16))):
        buf = ctypes.create_string_buffer(data, len(data))
        assert lib.cudnnBackendSetAttribute(t, name, type_, len(data) // WIDTH[type_], buf) == 0
    assert lib.cudnnBackendFinalize(t) == 0
    n, out = ctypes.c_int64(-1), (ctypes.c_int64 * 8)()
    answers = []
    for requested, array in ((8, None), (2, out), (0, out), (0, None)):
        assert lib.cudnnBackendGetAttribute(t, 902, 3, requested, ctypes.byref(n), array) == 0
        answers.append(n.value)
    assert answers == [4, 2, 0, 4]        # what lib_cudnn.c's answer_count gives (the door test checks it there)
    assert lib.cudnnBackendGetAttribute(t, 902, 3, 4, None, out) == 0 and list(out[:4]) == list(dims)
    # the real side's dump of a finalized tensor: every dimension, its count the attribute's total
    monkeypatch.setenv("RGPU_CUDA_LIB_DIR", str(Path(found).parent))
    from rgpu.server.cuda.libs import cudnn_real
    real = cudnn_real.Library(None, None)
    real._need_lib()
    real.descs[1] = [t, 17]
    entries = {name: (count, data) for name, _, count, data in undump(real.readable(1))}
    assert entries[902] == (4, struct.pack("<4q", *dims)) and entries[906] == (1, struct.pack("<q", 7))
    del real.descs[1]
    assert lib.cudnnBackendDestroyDescriptor(t) == 0
