"""A Python number where an op's schema says Tensor (``y + 1.0`` reaches the server as ``add.out`` so)
runs on the server's C++ op path, with the Python path's values, dtypes and type promotion.

Each case feeds the same messages to an executor on each path, checks that the C++ one ran the op
itself (``FastOps.ran``) and compares both outputs' bytes with torch on the CPU."""
from __future__ import annotations

import pytest
import torch

from rgpu import config
from rgpu.bench import server_ops
from rgpu.protocol.ops import Msg
from rgpu.server.ops import fast_op
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.server.ops.executor import Executor
from rgpu.server.route import OpFailed, Session

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(fast_op.load() is None, reason=f"no C++ op path here: {fast_op.why_not()}")


def _desc(sid: int, t: torch.Tensor) -> list:
    return [sid, t.untyped_storage().nbytes(), CODE_BY_DTYPE[t.dtype], list(t.shape), list(t.stride()), 0, 0]


@pytest.fixture
def pair():
    exs = [Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cpu", server_c=c)))
           for c in (True, False)]
    yield exs
    for ex in exs:
        ex.close()


def _run(exs, op, args_of, result: torch.Tensor, inputs: list[torch.Tensor], out_kwarg: bool = False) -> torch.Tensor:
    """``op`` on both executors: ``args_of(wires)`` gives its args from the inputs' wire values; the output
    (shaped as ``result``) bound to a fresh id, or passed as ``out=``. Returns its bytes as ``result``'s dtype."""
    ran = exs[0].fast.ran, exs[0].fast.declined
    got = []
    for ex in exs:
        wires = []
        for i, t in enumerate(inputs, start=10):
            ex.handle([Msg.UPLOAD, [], _desc(i, t)], [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())], False)
            wires.append({"t": _desc(i, t)})
        ex.handle([Msg.DEFINE, 1, f"{op._schema.name[6:]}.{op._overloadname}", str(op._schema)], [], False)
        out = _desc(99, result)
        if out_kwarg:
            ex.handle([Msg.OP, [], 1, args_of(wires), {"out": {"t": out}}, None], [], False)
        else:
            ex.handle([Msg.OP, [], 1, args_of(wires), {}, [out]], [], False)
        _, bufs = ex.handle([Msg.DOWNLOAD, [], out], [], True)
        got.append(torch.frombuffer(bytearray(bufs[0]), dtype=torch.uint8))
    assert (exs[0].fast.ran - ran[0], exs[0].fast.declined - ran[1]) == (1, 0), "the C++ path did not run it"
    assert torch.equal(got[0], got[1])
    return got[0].view(result.dtype).reshape(result.shape)


def test_a_float_added_to_a_float_tensor_by_add_out_runs_in_cpp_and_matches_the_cpu(pair):
    x = torch.randn(4)
    want = x + 1.0
    got = _run(pair, aten.add.out, lambda w: [w[0], 1.0], want, [x], out_kwarg=True)
    assert torch.equal(got, want)


def test_a_float_added_to_an_int_tensor_promotes_as_a_python_number_does(pair):
    a = torch.tensor([1, 2, -3])
    want = a + 1.5  # a wrapped number: float32, not float64
    assert want.dtype is torch.float32
    assert torch.equal(_run(pair, aten.add.Tensor, lambda w: [w[0], 1.5], want, [a]), want)


@pytest.mark.parametrize("number", [2, True, -7.25])
def test_an_int_a_bool_and_a_float_multiply_as_on_the_cpu(pair, number):
    x = torch.randn(3, 2)
    want = x * number
    assert torch.equal(_run(pair, aten.mul.Tensor, lambda w: [w[0], number], want, [x]), want)


def test_an_op_torch_ops_takes_no_number_for_gets_a_0_dim_tensor_as_on_the_python_path(pair):
    a = torch.tensor([5, -4, 7])
    want = torch.remainder(a, torch.tensor(3))  # what Resolved.numbers_as_tensors gives: an int64 0-dim tensor
    assert torch.equal(_run(pair, aten.remainder.Tensor, lambda w: [w[0], 3], want, [a]), want)


def test_the_server_microbench_chain_runs_every_add_in_cpp_with_the_chains_values():
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cpu", server_c=True)))
    import msgpack
    try:
        setup, chain = server_ops.messages(chain=50, base=100)
        for f in setup + chain:
            ex.handle(msgpack.unpackb(f, raw=False), [], False)
        assert ex.fast.ran == 1 + 50 and ex.fast.declined == 0  # x's fill_, then every add
        _, bufs = ex.handle([Msg.DOWNLOAD, [], [150, 16, 6, [4], [1], 0, 0]], [], True)
        assert torch.equal(torch.frombuffer(bytearray(bufs[0]), dtype=torch.float32), torch.full((4,), 51.0))
        assert len(ex.table.entries) == 3  # x and the last two results: every other one freed
    finally:
        ex.close()


def test_an_index_redefined_as_a_refused_op_no_longer_runs_on_the_cpp_path():
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cpu", server_c=True)))
    try:
        x = torch.ones(3)
        ex.handle([Msg.UPLOAD, [], _desc(10, x)], [memoryview(x.view(torch.uint8).numpy())], False)
        ex.handle([Msg.DEFINE, 1, "add.Tensor", str(aten.add.Tensor._schema)], [], False)
        ex.handle([Msg.OP, [], 1, [{"t": _desc(10, x)}, 1.0], {}, [_desc(11, x)]], [], False)
        assert ex.fast.ran == 1
        ex.handle([Msg.DEFINE, 1, "save.default", "aten::save(...)"], [], False)
        with pytest.raises(OpFailed, match="refused"):
            ex.handle([Msg.OP, [], 1, [{"t": _desc(10, x)}, 1.0], {}, [_desc(12, x)]], [], False)
        assert ex.fast.ran == 1
    finally:
        ex.close()
