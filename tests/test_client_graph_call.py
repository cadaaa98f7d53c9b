"""A shipped graph's calls made and posted in C++ (graph_call.cpp) send what the Python path sends and train alike.

Each test starts sessions of its own on the test server, with ``RGPU_NATIVE`` auto
(the C++ call) or off (compile.py's Python call), and leaves a fast one behind.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from device_helpers import rgpu_device, tiny_gpt  # noqa: F401
from test_fast_path_ops import Recorder

from rgpu.device_backend import compile as rcompile
from rgpu.protocol.ops import Msg


@pytest.fixture
def start(rgpu_device, rgpu_server, monkeypatch):  # noqa: F811
    """``start(fast)``: a new device session on the test server, recorded, dynamo reset; counts Python's calls."""
    from rgpu.device_backend import startup

    python_calls = []
    call = rcompile.ShippedGraph._call

    def counted(self, s, args):
        python_calls.append(self.gid)
        return call(self, s, args)

    monkeypatch.setattr(rcompile.ShippedGraph, "_call", counted)

    def begin(fast: bool) -> tuple[Recorder, list]:
        torch._dynamo.reset()
        monkeypatch.setenv("RGPU_NATIVE", "auto" if fast else "off")
        rec = Recorder(rgpu_server.connect("ops"))
        startup.use(rec)
        python_calls.clear()
        return rec, python_calls

    yield begin
    torch._dynamo.reset()
    monkeypatch.setenv("RGPU_NATIVE", "auto")
    startup.use(rgpu_server.connect("ops"))


def _runs(messages: list) -> list:
    """The RUN messages, graph and storage ids renamed in order of first sight (events left out)."""
    sids: dict = {}
    gids: dict = {}

    def desc(d):
        return None if d is None else [sids.setdefault(d[0], len(sids)), *d[1:]]

    def value(v):
        return desc(v) if isinstance(v, list) else v

    return [[gids.setdefault(m[2], len(gids)), [value(v) for v in m[3]], [desc(o) for o in m[4]]]
            for m in messages if m[0] == Msg.RUN]


def _train(model, opt, batches) -> list:
    losses = []
    for x, y in batches:
        _, loss = model(x.to("rgpu"), y.to("rgpu"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _batches(n: int = 3):
    gen = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, 97, (2, 2, 16), generator=gen)) for _ in range(n)]


def _compiled_training(mode=None):
    model = tiny_gpt().to("rgpu")
    opt = model.configure_optimizer(1e-3)
    losses = _train(torch.compile(model, backend="rgpu", mode=mode), opt, _batches())
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_a_compiled_training_run_sends_the_same_run_messages_from_cpp_and_from_python(start):
    rec, python_calls = start(False)
    off_losses, off_params = _compiled_training()
    off = _runs(rec.seen)
    assert python_calls and len(python_calls) == len(off)
    rec, python_calls = start(True)
    on_losses, on_params = _compiled_training()
    on = _runs(rec.seen)
    assert not python_calls  # every call went through C++
    assert len(on) == len(off) == 6  # forward and backward, three steps
    for n, (x, y) in enumerate(zip(on, off)):
        assert x == y, f"RUN {n} differs:\n  cpp {x}\n  python {y}"
    assert on_losses == off_losses
    for n, (a, b) in enumerate(zip(on_params, off_params)):   # bitwise; a failure names the parameter and how far
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=n: f"parameter {n}: {m}")


def test_a_compiled_training_run_through_cpp_matches_the_cpu(start):
    start(True)
    losses, params = _compiled_training("reduce-overhead")
    ref = tiny_gpt()
    ref_losses = _train_cpu(ref, ref.configure_optimizer(1e-3), _batches())
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p, q.detach(), atol=1e-5, rtol=1e-4)


def _train_cpu(model, opt, batches) -> list:
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _Mixed(nn.Module):
    """Outputs of every kind: fresh, an input, views of an input and of a fresh output, a storage two views share."""

    def forward(self, x, w):
        y = x @ w
        both = torch.cat([y, y * 2]).view(2, *y.shape)
        return y.relu(), w, x[0], y.t(), both[0], both[1], (x.sum(0) > 0).to(torch.int64)


@pytest.mark.parametrize("fast", [True, False], ids=["cpp", "python"])
def test_graph_outputs_of_every_kind_match_eager_and_the_cpu(start, fast):
    _, python_calls = start(fast)
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    got = torch.compile(_Mixed(), backend="rgpu")(x.to("rgpu"), w.to("rgpu"))
    assert bool(python_calls) != fast
    want = _Mixed()(x, w)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a.cpu(), b)
    assert got[4].untyped_storage().data_ptr() == got[5].untyped_storage().data_ptr()


class _WithCpuScalar(nn.Module):
    def forward(self, x, s):
        return x * s + 1


def test_an_input_only_python_sends_leaves_that_call_to_python(start):
    _, python_calls = start(True)
    compiled = torch.compile(_WithCpuScalar(), backend="rgpu")
    x = torch.randn(2, 3)
    for scale in (2.0, -0.5):  # a CPU 0-dim tensor: its value travels ({"s": ...}), Python's encoding
        got = compiled(x.to("rgpu"), torch.tensor(scale))
        torch.testing.assert_close(got.cpu(), x * scale + 1)
    assert python_calls
