"""torch.compile(backend="rgpu"): graphs shipped once, one message per call, eager where they cannot go."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from device_helpers import rgpu_device, tiny_gpt  # noqa: F401

import rgpu
from rgpu.device_backend import compile as rcompile
from rgpu.server.ops.graphs import GraphError, Graphs
from rgpu.server.ops.handles import HandleTable


@pytest.fixture
def fresh_dynamo(rgpu_device):
    """Dynamo forgets earlier tests' graphs (its per-code recompile limit would otherwise bite)."""
    torch._dynamo.reset()
    yield rgpu_device
    torch._dynamo.reset()


def _shipped() -> int:
    return rcompile.stats()["graphs_shipped"]


def _train(model, opt, x, y):
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def test_a_compiled_training_step_ships_two_graphs_once_and_matches_the_cpu(fresh_dynamo):
    ref, model = tiny_gpt(), tiny_gpt().to("rgpu")
    compiled = torch.compile(model, backend="rgpu")
    ref_opt, opt = ref.configure_optimizer(1e-3), model.configure_optimizer(1e-3)
    gen = torch.Generator().manual_seed(0)
    before = _shipped()
    for _ in range(3):
        x, y = torch.randint(0, 97, (2, 2, 16), generator=gen)
        got = _train(compiled, opt, x.to("rgpu"), y.to("rgpu"))
        want = _train(ref, ref_opt, x, y)
        assert got == pytest.approx(want, abs=1e-5)
    assert _shipped() - before == 2  # forward and backward, shipped at the first step only
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, atol=1e-5, rtol=1e-4)


def test_a_compiled_training_step_that_reads_its_loss_costs_one_round_trip(fresh_dynamo):
    model = tiny_gpt().to("rgpu")
    compiled = torch.compile(model, backend="rgpu")
    opt = model.configure_optimizer(1e-3)
    x, y = torch.randint(0, 97, (2, 2, 16), generator=torch.Generator().manual_seed(1)).to("rgpu")
    for _ in range(2):  # compile, ship, define the optimizer's ops
        _train(compiled, opt, x, y)
    rgpu.stats(reset=True)
    _train(compiled, opt, x, y)
    counts = rgpu.stats()
    assert counts["round_trips"] == 1, counts
    # forward and backward are one message each; the rest is the optimizer's foreach ops
    assert counts["messages"] < 40, counts


def test_compiled_inference_matches_eager_on_the_device_and_the_cpu(fresh_dynamo):
    ref = tiny_gpt()
    model = tiny_gpt().to("rgpu").eval()
    compiled = torch.compile(model, backend="rgpu")
    x = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = compiled(x.to("rgpu"))[0].cpu()
        eager = model(x.to("rgpu"))[0].cpu()
        want = ref(x)[0]
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_new_shape_ships_new_graphs_and_a_shape_seen_before_reuses_its_own(fresh_dynamo):
    lin = nn.Linear(4, 3)
    ref = nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    compiled = torch.compile(lin.to("rgpu"), backend="rgpu")
    shipped = []
    for n in (2, 5, 7, 5):
        x = torch.randn(n, 4)
        compiled(x.to("rgpu")).sum().backward()
        ref(x).sum().backward()
        shipped.append(_shipped())
    assert shipped[1] > shipped[0] and shipped[2] > shipped[1]  # each new shape: its own graphs
    assert shipped[3] == shipped[2]                             # 5 again: nothing new
    torch.testing.assert_close(lin.weight.grad.cpu(), ref.weight.grad)


class _ViewsAndInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        return y.relu(), y.t(), x[0], y.detach()


def test_outputs_that_view_inputs_or_each_other_alias_as_in_eager(fresh_dynamo):
    model = _ViewsAndInputs().to("rgpu")
    compiled = torch.compile(model, backend="rgpu")
    x = torch.randn(2, 4).to("rgpu")
    got, want = compiled(x), model(x)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a.cpu(), b.cpu())
    row = got[2]
    x.add_(1)  # x[0] from the graph is a view of x, as in eager
    torch.testing.assert_close(row.cpu(), x[0].cpu())


def test_batch_norm_running_stats_update_through_the_graph_as_on_the_cpu(fresh_dynamo):
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
    model.load_state_dict(ref.state_dict())
    compiled = torch.compile(model.to("rgpu"), backend="rgpu")
    for _ in range(2):
        x = torch.randn(6, 4)
        torch.testing.assert_close(compiled(x.to("rgpu")).cpu(), ref(x), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model[1].running_mean.cpu(), ref[1].running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(model[1].running_var.cpu(), ref[1].running_var, atol=1e-6, rtol=1e-5)


class _Scalar(nn.Module):
    def forward(self, x):
        return x * torch.tensor(3.0) + 1  # a CPU scalar made in forward: a constant of the graph


class _Constant(nn.Module):
    def forward(self, x):
        return x * torch.tensor([1.0, 2.0, 3.0, 4.0]).to(x.device)  # a CPU tensor made in forward


def test_a_cpu_scalar_the_graph_holds_is_shipped_as_a_value(fresh_dynamo):
    before = _shipped()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback
        out = torch.compile(_Scalar(), backend="rgpu")(torch.ones(2, 4, device="rgpu"))
    assert torch.equal(out.cpu(), torch.full((2, 4), 4.0)) and _shipped() == before + 1


@torch.library.custom_op("rgputest::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


class _CustomOp(nn.Module):
    def forward(self, x):
        return _twice(x) + 1


@pytest.mark.parametrize("module, why, want", [
    (_Constant, "a constant the graph holds", torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(2, 4)),
    (_CustomOp, "an op outside aten", torch.full((2, 4), 3.0))])
def test_a_graph_that_cannot_be_shipped_runs_eagerly_with_one_warning(fresh_dynamo, module, why, want):
    compiled = torch.compile(module(), backend="rgpu")
    eager_before, shipped_before = rcompile.stats()["graphs_eager"], _shipped()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out = compiled(torch.ones(2, 4, device="rgpu"))
    assert torch.equal(out.cpu(), want)
    ours = [str(w.message) for w in caught if str(w.message).startswith("rgpu:")]
    assert len(ours) == 1 and why in ours[0] and "eagerly" in ours[0], ours
    assert rcompile.stats()["graphs_eager"] == eager_before + 1 and _shipped() == shipped_before


def test_reduce_overhead_mode_reaches_the_server_which_interprets_on_a_cpu(fresh_dynamo):
    lin = nn.Linear(4, 3).to("rgpu")
    compiled = torch.compile(lin, backend="rgpu", mode="reduce-overhead")
    x = torch.randn(2, 4).to("rgpu")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).cpu(), lin(x).cpu())
    want = "interpreted" if rgpu_device_kind() == "cpu" else "inductor (reduce-overhead, CUDA graphs"
    mine = [i for i in rcompile.info() if i["runs"]]
    assert mine and all(i["backend"].startswith(want) and i["error"] is None for i in mine), mine


def test_a_cuda_graph_mode_on_a_gpu_server_compiles_without_a_warning(rgpu_device, monkeypatch):
    monkeypatch.setattr(rgpu_device, "kind", "cuda")   # the server captures CUDA graphs itself; nothing runs here
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mode in ("reduce-overhead", "max-autotune", "default"):
            rcompile._aot(mode)


def _graphs() -> Graphs:
    table = HandleTable([torch.device("cpu")])
    ops = {1: type("R", (), {"name": "aten.add.Tensor", "op": torch.ops.aten.add.Tensor})()}

    def resolve(index):
        if index not in ops:
            raise KeyError(f"op #{index} used before it was defined")
        return ops[index]
    return Graphs(table, resolve, on_gpu=False)


@pytest.mark.parametrize("wire, why", [
    ({"inputs": 1, "nodes": [[1, [{"n": 0}, {"n": 1}], {}]], "outputs": [1]}, "earlier node"),
    ({"inputs": 1, "nodes": [[2, [{"n": 0}], {}]], "outputs": [1]}, "before it was defined"),
    ({"inputs": 1, "nodes": [[1, [{"n": 0}, {"n": 0}], {}]], "outputs": [5]}, "not a node"),
    ({"inputs": 1, "nodes": "x", "outputs": []}, "needs inputs"),
    ({"inputs": 1, "nodes": [[0, 7, 0]], "outputs": []}, "bad item reference"),
])
def test_the_server_refuses_a_malformed_graph_and_says_why(wire, why):
    g = _graphs()
    with pytest.raises(GraphError, match=why):
        g.define([11, 1, {}, wire], [])
    info, _ = g.info([14, 1], [])
    assert why in info["error"]


@pytest.mark.slow
def test_a_gpu_server_compiles_shipped_graphs_with_inductor_and_matches_the_interpreter():
    # on_gpu=True on CPU tensors: the Inductor path of a GPU server, run here with its CPU backend
    aten = torch.ops.aten
    ops = {i: type("R", (), {"name": str(op), "op": op})()
           for i, op in enumerate((aten.t.default, aten.addmm.default, aten.relu.default), start=1)}
    wire = {"inputs": 3, "nodes": [[1, [{"n": 1}], {}], [2, [{"n": 2}, {"n": 0}, {"n": 3}], {}],
                                   [3, [{"n": 4}], {}]], "outputs": [5, 4]}
    x, w, b = torch.randn(2, 4), torch.randn(3, 4), torch.randn(3)
    results = {}
    for on_gpu in (False, True):
        g = Graphs(HandleTable([torch.device("cpu")]), ops.__getitem__, on_gpu=on_gpu)
        g.define([11, 1, {}, wire], [])
        with torch.inference_mode():
            results[on_gpu] = g.graphs[1].run([x, w, b])
        info, _ = g.info([14, 1], [])
        assert info["backend"] == ("inductor (default)" if on_gpu else "interpreted"), info
    for a, b_ in zip(results[False], results[True]):
        torch.testing.assert_close(a, b_)
    torch.testing.assert_close(results[True][0], torch.relu(x @ w.t() + b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU: a CUDA server compiles with Inductor")
def test_on_a_gpu_server_graphs_go_through_inductor_and_match_the_cpu(fresh_dynamo):
    # the reference is the CPU: CUDA autograd cannot run in a process with PrivateUse1 registered (torch #161129)
    if rgpu_device_kind() != "cuda":
        pytest.skip("the test server runs on the CPU")
    ref, model = tiny_gpt(), tiny_gpt().to("rgpu")
    compiled = torch.compile(model, backend="rgpu")
    ref_opt, opt = ref.configure_optimizer(1e-3), model.configure_optimizer(1e-3)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = torch.randint(0, 97, (2, 2, 16), generator=gen)
        got = _train(compiled, opt, x.to("rgpu"), y.to("rgpu"))
        want = _train(ref, ref_opt, x, y)
        assert got == pytest.approx(want, abs=1e-4)
    backends = {i["backend"] for i in rcompile.info() if i["runs"]}
    assert backends and all(b.startswith("inductor") for b in backends), rcompile.info()


def rgpu_device_kind() -> str:
    from rgpu.device_backend import session

    return session.get().kind
