"""The server's C++ op path (``server/ops/fast_op.cpp``) against the Python executor, value by value.

Each case drives two in-process executors, one on each path, with the same messages,
and compares every output's bytes with the other's and with torch on the CPU; the C++
executor must have run the op itself (``FastOps.ran``), or left it to Python where it
should (``declined``).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rgpu import config
from rgpu.protocol.ops import Event, Msg
from rgpu.server.ops import fast_op
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.server.route import OpFailed, Session
from rgpu.server.ops.executor import Executor

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(fast_op.load() is None, reason=f"no C++ op path here: {fast_op.why_not()}")


def wire(sid: int, t: torch.Tensor) -> dict:
    """``t``'s descriptor as the client sends it: a storage of exactly its bytes."""
    return {"t": [sid, t.untyped_storage().nbytes(), CODE_BY_DTYPE[t.dtype], list(t.shape), list(t.stride()),
                  t.storage_offset(), 0]}


_open_pairs: list = []


@pytest.fixture(autouse=True)
def _close_pairs():
    """Each test's executors closed after it, as a session's are: on a GPU an executor left to the garbage
    collector would unmap its upload ring while CUDA still has it registered (the next ring there fails)."""
    yield
    while _open_pairs:
        pair = _open_pairs.pop()
        pair.cpp.close()
        pair.py.close()


class Pair:
    """A C++-path executor and a Python-path one, fed the same messages."""

    def __init__(self, device: str = "cpu"):
        self.cpp, self.py = (Executor(Session(id="t", route="ops", settings=config.settings(
            environ={}, device=device, server_c=c))) for c in (True, False))
        _open_pairs.append(self)
        self.index = {}
        self.sid = 100

    def send(self, meta, buffers=(), reply=False):
        got = [ex.handle(meta, list(buffers), reply) for ex in (self.cpp, self.py)]
        return got[0]

    def upload(self, t: torch.Tensor) -> dict:
        self.sid += 1
        w = wire(self.sid, t)
        self.send([Msg.UPLOAD, [], w["t"]], [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")])
        return w

    def define(self, op) -> int:
        if op not in self.index:
            self.index[op] = len(self.index) + 1
            self.send([Msg.DEFINE, self.index[op], f"{op._schema.name[6:]}.{op._overloadname}", str(op._schema)])
        return self.index[op]

    def op(self, op, args, kwargs=None, results=()):
        """Run ``op``; ``results``: example tensors shaped as its outputs, each bound to a fresh id."""
        outs = []
        for r in results:
            self.sid += 1
            outs.append(wire(self.sid, r)["t"])
        self.send([Msg.OP, [], self.define(op), args, kwargs or {}, outs])
        return [{"t": d} for d in outs]

    def read(self, w: dict, dtype=None) -> torch.Tensor:
        """The tensor's bytes from both executors, which must agree; as ``dtype``."""
        values = []
        for ex in (self.cpp, self.py):
            _, bufs = ex.handle([Msg.DOWNLOAD, [], w["t"]], [], True)
            values.append(torch.frombuffer(bytearray(bufs[0]), dtype=torch.uint8))
        assert torch.equal(values[0], values[1])
        return values[0].view(dtype or torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_argument_kinds_of_a_training_step_run_on_the_cpp_path_and_match_python_and_the_cpu(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (the device tool's host)")
    p = Pair(device)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    w = torch.randn(5, 4)
    ids = torch.tensor([2, 0, 1])
    A, B, W, IDS = p.upload(a), p.upload(b), p.upload(w), p.upload(ids)
    out = p.upload(torch.zeros(3, 4))
    checks = []
    # Tensor, Scalar (alpha by keyword), a result bound to a fresh id
    (r,) = p.op(aten.add.Tensor, [A, B], {"alpha": 2}, [a])
    checks.append((r, a + 2 * b))
    # out= by keyword, written in place
    p.op(aten.mul.out, [A, B], {"out": out})
    checks.append((out, a * b))
    # int[]? as None and as a list, bool, ScalarType? by keyword
    s1 = p.upload(torch.zeros(()))
    p.op(aten.sum.IntList_out, [A, None], {"out": s1})
    checks.append((s1, a.sum()))
    s2 = p.upload(torch.zeros(4))
    p.op(aten.sum.IntList_out, [A, [0], False], {"dtype": {"d": CODE_BY_DTYPE[torch.float32]}, "out": s2})
    checks.append((s2, a.sum(0)))
    # float, str (gelu's approximate), defaults left out
    (g,) = p.op(aten.gelu.default, [A], {"approximate": "tanh"}, [a])
    checks.append((g, torch.nn.functional.gelu(a, approximate="tanh")))
    (l,) = p.op(aten.leaky_relu.default, [A, 0.3], {}, [a])
    checks.append((l, torch.nn.functional.leaky_relu(a, 0.3)))
    # Tensor with int64 ids, int
    (e,) = p.op(aten.index_select.default, [W, 0, IDS], {}, [w[ids]])
    checks.append((e, w[ids]))
    # Tensor?[] (advanced indexing)
    (ix,) = p.op(aten.index.Tensor, [W, [IDS]], {}, [w[ids]])
    checks.append((ix, w[ids]))
    # Tensor[] and an int
    (c,) = p.op(aten.cat.default, [[A, B], 1], {}, [torch.cat([a, b], 1)])
    checks.append((c, torch.cat([a, b], 1)))
    # three results
    ln = torch.ops.aten.native_layer_norm.default(a, [4], None, None, 1e-5)
    r0, r1, r2 = p.op(aten.native_layer_norm.default, [A, [4], None, None, 1e-5], {}, ln)
    checks += [(r0, ln[0]), (r1, ln[1]), (r2, ln[2])]
    # Scalar[] and in-place lists, then a factory op with dtype, layout, device and memory format
    x1, x2 = p.upload(a.clone()), p.upload(b.clone())
    p.op(aten._foreach_add_.ScalarList, [[x1, x2], [1.5, -2]])
    checks += [(x1, a + 1.5), (x2, b - 2)]
    z = torch.zeros(2, 3)
    (zr,) = p.op(aten.zeros.default, [[2, 3]], {"dtype": {"d": CODE_BY_DTYPE[torch.float32]}, "layout": {"l": "strided"},
                                                "device": {"v": ["rgpu", 0]}, "pin_memory": False}, [z])
    checks.append((zr, z))
    (cl,) = p.op(aten.clone.default, [A], {"memory_format": {"m": "contiguous_format"}}, [a])
    checks.append((cl, a))
    for got, want in checks:  # both paths ran the same kernels: equal; the GPU's against the CPU: close
        value = p.read(got, want.dtype).view(want.shape)
        assert torch.equal(value, want) if device == "cpu" else torch.allclose(value, want, rtol=1e-5, atol=1e-6)
    # one table for both paths: the same ids, bytes counted and peak
    assert sorted(p.cpp.table.entries) == sorted(p.py.table.entries)
    assert (p.cpp.table.allocated, p.cpp.table.peak) == (p.py.table.allocated, p.py.table.peak)
    assert all(r.fast for r in p.cpp.ops.values()) and p.cpp.fast.ran == 13 and len(p.index) == 12
    assert p.cpp.fast.declined == 0
    assert p.py.fast is None


def test_what_the_cpp_path_does_not_take_is_left_to_python_with_the_same_result():
    p = Pair()
    a = torch.tensor([5.0, -3.0, 7.5])
    A = p.upload(a)
    # a complex number where the schema says Tensor (PyTorch wraps scalars): Python makes the scalar
    # tensor (a real number runs in C++: tests/test_fast_op_numbers.py)
    c = torch.tensor([1 + 2j, -3j])
    C = p.upload(c)
    (r,) = p.op(aten.mul.Tensor, [C, {"c": [0.5, -1.0]}], {}, [c])
    # a number for a Scalar, which the C++ path takes
    (m,) = p.op(aten.mul.Scalar, [A, 2.0], {}, [a])
    assert torch.equal(p.read(r, torch.complex64), c * (0.5 - 1j)) and torch.equal(p.read(m), a * 2)
    assert p.cpp.fast.declined == 1 and p.cpp.fast.ran == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"alpha": 1, "nonsense": 3}, "argument"),            # an unknown keyword: the Python path's error
    ({"alpha": "two"}, "alpha"),                           # a value of the wrong kind
])
def test_a_bad_argument_fails_the_same_way_on_both_paths(kwargs, message):
    p = Pair()
    A = p.upload(torch.ones(3))
    errors = []
    for ex in (p.cpp, p.py):
        ex.handle([Msg.DEFINE, 1, "add.Tensor", str(aten.add.Tensor._schema)], [], False)
        with pytest.raises(OpFailed, match=message) as info:
            ex.handle([Msg.OP, [], 1, [A, A], kwargs, [wire(50, torch.ones(3))["t"]]], [], False)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_a_failing_op_on_the_cpp_path_names_the_op_and_poisons_its_outputs_as_python_does():
    p = Pair()
    A, B = p.upload(torch.ones(3)), p.upload(torch.ones(4))
    errors = []
    for ex in (p.cpp, p.py):
        ex.handle([Msg.DEFINE, 1, "add.Tensor", str(aten.add.Tensor._schema)], [], False)
        with pytest.raises(OpFailed) as info:
            ex.handle([Msg.OP, [], 1, [A, B], {}, [wire(60, torch.ones(3))["t"]]], [], False)
        errors.append((info.value.op, str(info.value)))
        with pytest.raises(OpFailed, match="size of tensor"):   # reading the output names the first failure
            ex.handle([Msg.DOWNLOAD, [], wire(60, torch.ones(3))["t"]], [], True)
    assert errors[0] == errors[1] and errors[0][0] == "aten.add.Tensor"
    assert "RuntimeError" in errors[0][1] and "Exception raised from" not in errors[0][1]   # no C++ backtrace
    assert p.cpp.fast.ran == 1


def test_an_output_that_aliases_its_input_is_copied_into_a_storage_of_its_own():
    p = Pair()
    a = torch.arange(6.0)
    A = p.upload(a)
    # alias returns its input: the client gave the result an id of its own, so it must be a copy
    (r,) = p.op(aten.alias.default, [A], {}, [a])
    inplace = p.upload(torch.zeros(1))
    p.op(aten.fill_.Scalar, [A, 9.0])
    del inplace
    assert torch.equal(p.read(r), a) and torch.equal(p.read(A), torch.full((6,), 9.0))
    assert p.cpp.fast.ran == 2


@pytest.mark.parametrize("size, stride, offset", [
    ([3, 4], [4, 1], 0), ([4, 3], [1, 4], 0), ([2, 2], [6, 1], 4), ([12], [1], 0), ([2, 0, 3], [3, 3, 1], 11),
    ([], [], 7), ([2, 3], [0, 1], 2),                     # a scalar, a broadcast (stride 0)
])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_view_the_cpp_path_makes_of_a_storage_is_the_view_as_strided_makes(size, stride, offset, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (the device tool's host)")
    p = Pair(device)
    base = torch.arange(12.0)
    B = p.upload(base)
    sid, nbytes, code = B["t"][:3]
    view = {"t": [sid, nbytes, code, size, stride, offset, 0]}
    expect = torch.as_strided(base, size, stride, offset)
    entry = p.cpp.table.entries[sid]
    entry.flat.clear()                                     # what the upload made: the view is made anew
    entry.views.clear()
    (r,) = p.op(aten.mul.Tensor, [view, view], {}, [torch.empty(expect.shape)])
    assert p.cpp.fast.ran == 1 and len(entry.views) == 1 and not entry.flat   # made straight from the storage
    if expect.numel():                                     # an empty result has no bytes to read
        assert torch.equal(p.read(r).reshape(expect.shape), expect * expect)


@pytest.mark.parametrize("size, stride, offset", [
    ([4, 4], [4, 1], 0), ([3], [1], 10), ([3], [-1], 2), ([2], [1], -1), ([2, 1 << 62], [1 << 62, 1], 0),
])
def test_a_view_past_its_storage_fails_the_same_way_on_both_paths(size, stride, offset):
    p = Pair()
    B = p.upload(torch.arange(12.0))
    sid, nbytes, code = B["t"][:3]
    view = {"t": [sid, nbytes, code, size, stride, offset, 0]}
    errors = []
    for ex in (p.cpp, p.py):
        ex.handle([Msg.DEFINE, 1, "neg.default", str(aten.neg.default._schema)], [], False)
        with pytest.raises(OpFailed) as info:
            ex.handle([Msg.OP, [], 1, [view], {}, [wire(70, torch.ones(3))["t"]]], [], False)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert torch.equal(p.read(B), torch.arange(12.0))     # the storage is as it was


def _send_with_outs(p: Pair, op, args: list, example) -> list:
    """Run ``op`` on both executors with an output id for each tensor of ``example`` (its results as the
    client sizes them) and None for the rest; the wire descriptors (or None), in order."""
    outs = []
    for r in example:
        p.sid += 1
        outs.append(wire(p.sid, r) if isinstance(r, torch.Tensor) else None)
    p.send([Msg.OP, [], p.define(op), args, {}, [o["t"] if o else None for o in outs]])
    return outs


@pytest.mark.parametrize("device, masked", [("cpu", False), ("cpu", True),
                                            pytest.param("cuda", False, marks=pytest.mark.gpu)])
def test_fused_attention_runs_its_substitute_on_the_cpp_path_and_matches_python_and_torch(device, masked):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (the device tool's host)")
    from rgpu.ops_substitutes import substitute

    p = Pair(device)
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(2, 3, 37, 8, generator=g) for _ in range(4))   # 37 rows: lse padded on CUDA
    bias = torch.randn(2, 3, 37, 37, generator=g) if masked else None       # an additive mask, not causal
    Q, K, V, GO = (p.upload(t) for t in (q, k, v, go))
    B = p.upload(bias) if masked else None
    causal = not masked
    fwd, bwd = (aten._scaled_dot_product_fused_attention_overrideable.default,
                aten._scaled_dot_product_fused_attention_overrideable_backward.default)
    on = [t.to(device) for t in (go, q, k, v)]
    on_bias = bias.to(device) if masked else None
    example = substitute(f"{fwd._schema.name[6:]}.default", device)(*on[1:], on_bias, 0.0, causal, False)
    outs = _send_with_outs(p, fwd, [Q, K, V, B, 0.0, causal, False], example)
    mask = [True, True, True, False]
    tail = [None, None, example[4], example[5], 0.0, causal]
    grads_example = substitute(f"{bwd._schema.name[6:]}.default", device)(
        *on, on_bias, mask, example[0], example[1], *tail, example[6], example[7])
    grads = _send_with_outs(p, bwd, [GO, Q, K, V, B, mask, outs[0], outs[1], *tail, outs[6], outs[7]],
                            grads_example)
    assert p.cpp.fast.ran == 2 and p.cpp.fast.declined == 0            # both ran their recipe in C++
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=bias, is_causal=causal)
    o.backward(go)
    for w, ref in zip((outs[0], *grads[:3]), (o, qr.grad, kr.grad, vr.grad)):
        cpp, py = (torch.frombuffer(bytearray(ex.handle([Msg.DOWNLOAD, [], w["t"]], [], True)[1][0]),
                                    dtype=torch.float32).reshape(ref.shape) for ex in (p.cpp, p.py))
        torch.testing.assert_close(cpp, py)                              # the same kernels on both paths
        torch.testing.assert_close(cpp, ref.detach(), atol=2e-5, rtol=1e-4)   # and torch's own attention


def test_the_frees_a_message_carries_are_applied_in_cpp_and_leave_the_table_as_python_does():
    assert Event.FREE == 0 and Event.COPY == 1   # handle_table.h's kEventFree
    p = Pair()
    A, B, C = (p.upload(torch.full((4,), float(i))) for i in range(3))
    (r,) = p.op(aten.add.Tensor, [A, B], {}, [torch.ones(4)])
    neg = p.define(aten.neg.default)
    free = [Event.FREE, A["t"][0], Event.FREE, B["t"][0], Event.FREE, 12345]   # 12345: never bound
    grow = [Event.COPY, 900, 32, 0, C["t"][0], 16]                            # C's bytes into a new storage
    for events in (free, grow + [Event.FREE, C["t"][0]]):
        p.send([Msg.OP, events, neg, [r], {}, [wire(p.sid + 1, torch.ones(4))["t"]]])
        p.sid += 1
    for ex in (p.cpp, p.py):
        assert sorted(ex.table.entries) == sorted(p.py.table.entries) and ex.table.allocated == p.py.table.allocated
    assert A["t"][0] not in p.cpp.table.entries and 900 in p.cpp.table.entries and p.cpp.fast.ran == 3
    assert type(p.cpp.table) is fast_op.load().HandleTable is not type(p.py.table)   # the frees went through C++
    assert torch.equal(p.read({"t": [900, 32, C["t"][2], [4], [1], 0, 0]}), torch.full((4,), 2.0))   # C's bytes, grown


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_whole_upload_is_done_in_cpp_after_its_frees_and_anything_unusual_is_left_to_python(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (the device tool's host)")
    p = Pair(device)
    values = [torch.arange(12, dtype=torch.int64).view(3, 4), torch.randn(5, 7), torch.tensor(True),
              torch.randn(3) + 1j * torch.randn(3), torch.zeros(0, 4)]
    sent = [p.upload(v) for v in values]
    assert p.cpp.fast.uploads == len(values) and p.py.fast is None
    for w, v in zip(sent[:-1], values):   # the last has no bytes to read
        assert torch.equal(p.read(w, v.dtype).view(v.shape), v)
    old = sent[1]["t"][0]
    x = torch.randn(5, 7)
    w = wire(700, x)
    p.send([Msg.UPLOAD, [Event.FREE, old, Event.FREE, 999], w["t"]], [memoryview(x.numpy()).cast("B")])
    assert p.cpp.fast.uploads == len(values) + 1 and old not in p.cpp.table.entries
    assert sorted(p.cpp.table.entries) == sorted(p.py.table.entries) and p.cpp.table.allocated == p.py.table.allocated
    assert torch.equal(p.read(w).view(5, 7), x)
    # left to Python: a strided destination, a poisoned one (new bytes replace the failed op's result),
    # events that are not all frees; the same table and bytes either way
    strided = [800, 4 * 12, CODE_BY_DTYPE[torch.float32], [4, 3], [1, 4], 0, 0]
    p.send([Msg.UPLOAD, [], strided], [memoryview(torch.arange(12.0).numpy()).cast("B")])
    failed = p.define(aten.mm.default)
    bad = wire(801, torch.zeros(2, 2))
    for ex in (p.cpp, p.py):
        with pytest.raises(OpFailed):
            ex.handle([Msg.OP, [], failed, [sent[0], sent[0]], {}, [bad["t"]]], [], False)   # 3x4 @ 3x4
    p.send([Msg.UPLOAD, [], bad["t"]], [memoryview(torch.ones(2, 2).numpy()).cast("B")])
    grown = [Event.COPY, 802, 4 * 12, 0, 800, 48]
    p.send([Msg.UPLOAD, grown, wire(803, torch.ones(2))["t"]], [memoryview(torch.ones(2).numpy()).cast("B")])
    assert p.cpp.fast.uploads == len(values) + 1
    assert p.cpp.handle([Msg.UPLOAD_INFO], [], True)[0]["pieces"]["whole in C++"] == len(values) + 1
    assert torch.equal(p.read({"t": strided}), torch.arange(12.0))      # the values, in the strided layout
    assert torch.equal(p.read(bad).view(2, 2), torch.ones(2, 2))
    flat = [CODE_BY_DTYPE[torch.float32], [12], [1], 0, 0]
    assert torch.equal(p.read({"t": [802, 48, *flat]}), p.read({"t": [800, 48, *flat]}))   # grown: its bytes
    # a size that does not match the destination: the same error on both paths
    errors = []
    for ex in (p.cpp, p.py):
        with pytest.raises(Exception) as err:
            ex.handle([Msg.UPLOAD, [], wire(900, torch.ones(4))["t"]], [memoryview(bytes(12))], False)
        errors.append((err.type, str(err.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("events", [[Event.FREE], [Event.FREE, "x"], [7, 1], "frees", [Event.FREE, [1]]])
def test_malformed_events_fail_the_same_way_on_both_paths(events):
    p = Pair()
    A = p.upload(torch.ones(3))
    errors = []
    for ex in (p.cpp, p.py):
        ex.handle([Msg.DEFINE, 1, "neg.default", str(aten.neg.default._schema)], [], False)
        try:
            ex.handle([Msg.OP, events, 1, [A], {}, [wire(80, torch.ones(3))["t"]]], [], False)
            errors.append(None)
        except Exception as exc:   # whatever the Python path raises, the C++ path must raise the same
            errors.append((type(exc), str(exc)))
    assert errors[0] == errors[1]


def test_a_session_never_waits_for_the_build_it_starts_one_in_the_background_and_runs_python(monkeypatch):
    started = []
    monkeypatch.setattr(fast_op.EXTENSION, "module", None)
    monkeypatch.setattr(fast_op.EXTENSION, "built", lambda: False)
    monkeypatch.setattr(fast_op, "_building", False)
    monkeypatch.setattr(fast_op.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cpu")))
    again = Executor(Session(id="u", route="ops", settings=config.settings(environ={}, device="cpu")))
    assert ex.fast is None and again.fast is None and "being built in the background" in ex.welcome()["op_path"]
    assert ex.welcome()["op_path_failed"] is False
    assert started == [[fast_op.sys.executable, "-m", "rgpu.server.ops.fast_op"]]   # once per process
    off = Executor(Session(id="v", route="ops", settings=config.settings(environ={}, device="cpu", server_c=False)))
    assert off.fast is None and len(started) == 1 and off.welcome()["op_path"] == "Python (RGPU_NATIVE=off)"
    monkeypatch.setattr(fast_op, "_failed", "CalledProcessError: no compiler")
    broken = Executor(Session(id="w", route="ops", settings=config.settings(environ={}, device="cpu")))
    assert broken.fast is None and "cannot be built here: CalledProcessError" in broken.welcome()["op_path"]
    assert broken.welcome()["op_path_failed"] is True
    off = Executor(Session(id="x", route="ops", settings=config.settings(environ={}, device="cpu", server_c=False)))
    assert off.welcome()["op_path_failed"] is False   # switched off, not failed, whatever an earlier build did


_small_int = st.one_of(st.integers(-3, 24), st.sampled_from([1 << 40, -(1 << 62), 1 << 70]))
_leaf = st.one_of(st.none(), st.booleans(), _small_int, st.floats(allow_nan=True), st.text(max_size=4),
                  st.binary(max_size=4))
_near_valid = st.builds(  # [sid, nbytes, dtype code, sizes, strides, offset, device]: mostly well formed
    lambda sid, n, code, size, stride, off, dev: [sid, n, code, size, stride, off, dev],
    st.sampled_from([101, 102, 0, -1, 1 << 40]), st.sampled_from([16, 0, 4, 1 << 62]),
    st.sampled_from([CODE_BY_DTYPE[torch.float32], CODE_BY_DTYPE[torch.int64], 99, -1]),
    st.lists(st.integers(-1, 5), max_size=3), st.lists(st.integers(-1, 5), max_size=3),
    st.sampled_from([0, 1, -1, 1 << 40]), st.sampled_from([0, 1, -1]))
_descriptor = st.one_of(_near_valid, st.lists(st.one_of(_small_int, st.lists(_small_int, max_size=3), st.none(),
                                                        st.text(max_size=2)), min_size=5, max_size=8))
_wire = st.recursive(
    st.one_of(_leaf, st.builds(lambda d: {"t": d}, _descriptor), st.builds(lambda d: {"t": d}, st.just(None)),
              st.dictionaries(st.sampled_from(["t", "d", "v", "l", "m", "j", "s", "c", "g", "x"]), _leaf, max_size=2)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=3), inner, max_size=2)),
    max_leaves=12)
_FUZZ_PAIR: list = []   # one pair for every example: a fresh one each would rebuild both executors


def _fuzz_pair() -> Pair:
    if not _FUZZ_PAIR:
        _FUZZ_PAIR.append(Pair())
        _FUZZ_PAIR[0].upload(torch.ones(4))   # storage 101: a real tensor for descriptors that happen to name it
    return _FUZZ_PAIR[0]


_FUZZED = [aten.add.Tensor, aten.mul.out, aten.sum.IntList_out, aten.cat.default, aten.index.Tensor,
           aten.zeros.default, aten._foreach_add_.ScalarList, aten.gelu.default, aten.native_layer_norm.default]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(_FUZZED) - 1), args=st.lists(_wire, max_size=6),
       kwargs=st.dictionaries(st.sampled_from(["out", "alpha", "dim", "dtype", "device", "approximate", "x"]),
                              _wire, max_size=3),
       outs=st.one_of(st.none(), st.lists(st.one_of(st.none(), _descriptor), max_size=3)))
def test_garbage_in_an_op_message_is_an_error_on_either_path_never_a_crash(which, args, kwargs, outs):
    p = _fuzz_pair()
    index = p.define(_FUZZED[which])
    for ex in (p.cpp, p.py):
        try:
            ex.handle([Msg.OP, [], index, args, kwargs, outs], [], False)
        except Exception:   # refused or failed, by name: the session goes on
            pass
    assert p.cpp.handle([Msg.OP, [], p.define(aten.add.Tensor), [wire(101, torch.ones(4))] * 2, {},
                         [wire(99, torch.ones(4))["t"]]], [], False) is None   # and still runs ops



@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.one_of(st.lists(st.one_of(st.sampled_from([Event.FREE, Event.COPY]), _small_int), max_size=6),
                        _leaf),
       desc=st.one_of(_descriptor, _leaf), nbytes=st.sampled_from([0, 3, 16, 32]))
def test_garbage_in_an_upload_is_the_same_error_on_either_path_never_a_crash(events, desc, nbytes):
    p = _fuzz_pair()
    outcomes = []
    for ex in (p.cpp, p.py):
        try:
            ex.handle([Msg.UPLOAD, events, desc], [memoryview(bytes(range(nbytes)))], False)
            outcomes.append(None)
        except Exception as exc:   # refused, by name: the session goes on
            outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1]
    assert sorted(p.cpp.table.entries) == sorted(p.py.table.entries)
    p.upload(torch.ones(4))   # and still takes uploads
