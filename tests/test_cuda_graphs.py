"""rgpu's own CUDA graphs for shipped graphs (server/ops/cuda_graphs.py), on a CPU.

A fake capturer stands in for torch.cuda.CUDAGraph with the same overwrite
semantics: a replay computes into the static outputs made at capture, so an
output a test still holds from an earlier call is overwritten unless evicted.
"""
from __future__ import annotations

import pytest
import torch

from rgpu.protocol.ops import Event
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.server.ops.cuda_graphs import MAX_RECAPTURES, WARM_CALLS, Replayer
from rgpu.server.ops.graphs import Graphs
from rgpu.server.ops.handles import HandleTable


class FakeCapturer:
    """Captures by remembering the graph and its static inputs; replays by calling it on them again."""

    device_type = "cpu"

    def __init__(self):
        self.warm_calls = self.captures = self.replays = 0
        self.graph = None

    def warm(self, fn, inputs, device):
        self.warm_calls += 1
        return fn(*inputs)

    def capture(self, fn, inputs, device):
        saved = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        outputs = fn(*inputs)  # made once, as a capture's static outputs are
        with torch.inference_mode():  # (the inputs may be the server's inference tensors)
            for x, old in zip(inputs, saved):
                if isinstance(x, torch.Tensor):
                    x.copy_(old)   # a capture records, it does not run: undo any write to an input
        self.captures += 1
        self.graph = (fn, list(inputs), list(outputs))
        return self.graph, outputs

    def replay(self, graph):
        fn, inputs, outputs = graph
        for static, fresh in zip(outputs, fn(*inputs)):
            if isinstance(static, torch.Tensor):
                static.copy_(fresh)
        self.replays += 1


def affine(w, x, s):
    return x @ w + s, (x * s).sum()


def _replayer(fn=affine, writes_inputs=False):
    table = HandleTable([torch.device("cpu")])
    return Replayer(fn, FakeCapturer(), table, writes_inputs), table


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g, w)


def _desc(sid: int, t: torch.Tensor) -> list:
    return [sid, t.untyped_storage().nbytes(), CODE_BY_DTYPE[t.dtype], list(t.shape), list(t.stride()),
            t.storage_offset(), 0]


def test_the_graph_is_captured_only_after_the_warm_calls():
    r, _ = _replayer()
    w = torch.randn(4, 3)
    for _ in range(WARM_CALLS):
        r([w, torch.randn(2, 4), 1.0])
    assert (r.capturer.warm_calls, r.capturer.captures, r.replays) == (WARM_CALLS, 0, 0)
    r([w, torch.randn(2, 4), 1.0])
    assert (r.capturer.captures, r.replays) == (1, 1)
    assert r.state() == "CUDA graphs"


def test_stable_inputs_are_captured_in_place_and_varying_ones_copied():
    r, _ = _replayer()
    w, xs = torch.randn(4, 3), [torch.randn(2, 4) for _ in range(WARM_CALLS + 1)]
    for x in xs:
        r([w, x, 1.0])
    c = r.captured
    assert [i for i, _, _ in c.stable] == [0] and [i for i, _, _ in c.varying] == [1]
    assert [i for i, _ in c.values] == [2]
    static_inputs = r.capturer.graph[1]
    assert static_inputs[0] is w                                   # in place
    assert static_inputs[1].data_ptr() != xs[-1].data_ptr()        # its own buffer


def test_replays_give_a_direct_calls_values_call_after_call():
    r, _ = _replayer()
    w = torch.randn(4, 3)
    xs = [torch.randn(2, 4) for _ in range(30)]  # all alive: each at its own address
    for x in xs:
        got = r([w, x, 0.5])
        _same(got, affine(w, x, 0.5))
        w.add_(0.25)  # a parameter updated in place between calls: same address, new values
    assert r.replays == len(xs) - WARM_CALLS and r.recaptures == 0


def test_a_stable_input_that_moves_is_captured_again_and_copied_from_then_on():
    r, _ = _replayer()
    w, x = torch.randn(4, 3), torch.randn(2, 4)
    for _ in range(WARM_CALLS + 2):
        r([w, x, 1.0])
    for _ in range(12):
        w = w.clone()  # the input moves at every call from now on (a batch the allocator placed twice alike)
        _same(r([w, x, 1.0]), affine(w, x, 1.0))
    assert r.recaptures == 1 and r.captures == 2 and r.reason is None and r.copied == {0}
    assert r.state() == "CUDA graphs, 1 recaptures"
    assert r.replays == 2 + 12 - WARM_CALLS + 1   # all but the call that found it moved, and the one after


def test_past_max_recaptures_that_copy_nothing_new_a_graph_runs_without_cuda_graphs_and_says_why(caplog):
    r, _ = _replayer()
    w = torch.randn(4, 3)
    rows, cols = torch.randn(2, 4), torch.randn(4, 2).t()   # one shape, two layouts
    x = rows
    for _ in range(40):
        if r.captured is not None:
            x = cols if x is rows else rows   # a new layout whenever there is a graph to miss
        _same(r([w, x, 1.0]), affine(w, x, 1.0))
    assert r.recaptures == MAX_RECAPTURES + 1 and r.captures == MAX_RECAPTURES + 1
    assert r.reason == f"input 1 changed layout after {MAX_RECAPTURES} recaptures"
    assert r.state().startswith("without CUDA graphs: input 1 changed layout")
    assert sum("without CUDA graphs" in m for m in caplog.messages) == 1
    replays = r.replays
    r([w, x.clone(), 1.0])
    assert r.replays == replays


def test_an_output_the_client_holds_keeps_its_values_and_a_freed_one_is_not_copied():
    r, table = _replayer()
    w, xs = torch.randn(4, 3), [torch.randn(2, 4) for _ in range(WARM_CALLS + 5)]  # all alive: varying
    for x in xs[:WARM_CALLS]:
        r([w, x, 1.0])
    previous = None  # (the held loss's descriptor, its values, the static output's address)
    for step, x in enumerate(xs[WARM_CALLS:]):
        y, loss = r([w, x, 1.0])
        _same([y, loss], affine(w, x, 1.0))
        if previous is not None:  # last step's loss, still held, kept its values; the static output moved on
            desc, values, static = previous
            assert loss.data_ptr() == static
            assert torch.equal(table.tensor(desc), values)
            assert table.view(desc, []).data_ptr() != static  # the cached view went with the old entry
            assert torch.equal(table.view(desc, []), values)
        loss_id, y_id = 10 + 2 * step, 11 + 2 * step
        for sid, t in ((loss_id, loss), (y_id, y)):
            table.bind(sid, t.untyped_storage(), 0)
            r.note_bound(sid, t.untyped_storage().data_ptr())
        desc = _desc(loss_id, loss)
        assert table.view(desc, []).data_ptr() == loss.data_ptr()  # a view cached before the next replay
        previous = desc, loss.clone(), loss.data_ptr()
        table.free(y_id)  # the client dropped y
    assert r.evictions == 4  # one loss per replay after the first; never a y


def test_a_new_non_tensor_value_runs_that_call_without_the_graph():
    r, _ = _replayer()
    w, x = torch.randn(4, 3), torch.randn(2, 4)
    for _ in range(WARM_CALLS + 1):
        r([w, x, 1.0])
    replays = r.replays
    _same(r([w, x, 2.0]), affine(w, x, 2.0))
    assert r.replays == replays and r.captured is not None
    _same(r([w, x, 1.0]), affine(w, x, 1.0))
    assert r.replays == replays + 1


def test_a_graph_that_writes_a_varying_input_writes_the_clients_tensor():
    def accumulate(acc, x):
        acc.add_(x)
        return (acc * 2,)
    r, _ = _replayer(accumulate, writes_inputs=True)
    accs = [torch.zeros(3) for _ in range(8)]  # a new accumulator each call: varying
    for k, acc in enumerate(accs):
        got = r([acc, torch.full((3,), float(k))])
        assert torch.equal(acc, torch.full((3,), float(k))), (k, acc)
        assert torch.equal(got[0], acc * 2)
    assert r.replays == len(accs) - WARM_CALLS


def test_a_capture_that_fails_leaves_the_graph_without_cuda_graphs():
    r, _ = _replayer()

    def refuse(fn, inputs, device):
        raise RuntimeError("operation not permitted when stream is capturing")
    r.capturer.capture = refuse
    w, x = torch.randn(4, 3), torch.randn(2, 4)
    for _ in range(WARM_CALLS + 3):
        _same(r([w, x, 1.0]), affine(w, x, 1.0))
    assert r.reason.startswith("capture failed: RuntimeError: operation not permitted")
    assert r.replays == 0


# ---- through the server's graph messages ------------------------------------------------------

def _train_like(graphs: Graphs, device: torch.device, steps: int = 6) -> dict:
    """Ship y = x @ w, loss = y.sum() and call it as a training loop would: w stays, a new x each step,
    y freed after the step, every loss kept. Checks every value; returns GRAPH_INFO."""
    aten, f32 = torch.ops.aten, CODE_BY_DTYPE[torch.float32]
    wire = {"inputs": 2, "nodes": [[1, [{"n": 0}, {"n": 1}], {}], [2, [{"n": 2}], {}]], "outputs": [2, 3]}
    graphs.define([11, 1, {"mode": "reduce-overhead"}, wire], [])
    w_desc = [1, 48, f32, [4, 3], [3, 1], 0, 0]
    sid, held, events = 100, [], []
    with torch.inference_mode():  # as the server's session loop
        w = graphs.table.tensor(w_desc).copy_(torch.randn(4, 3, device=device))
        for _ in range(steps):
            x_desc = [sid, 32, f32, [2, 4], [4, 1], 0, 0]
            x = graphs.table.tensor(x_desc).copy_(torch.randn(2, 4, device=device))
            y_desc, loss_desc = [sid + 1, 24, f32, [2, 3], [3, 1], 0, 0], [sid + 2, 4, f32, [], [], 0, 0]
            graphs.run([12, events, 1, [x_desc, w_desc], [y_desc, loss_desc]], [])
            torch.testing.assert_close(graphs.table.tensor(y_desc), aten.mm(x, w))
            held.append((loss_desc, aten.mm(x, w).sum()))
            events = [int(Event.FREE), sid + 1]  # y freed; every x kept (each at its own address), every loss
            sid += 3
        for desc, want in held:
            torch.testing.assert_close(graphs.table.tensor(desc), want)
    return graphs.info([14, 1], [])[0]


def test_a_shipped_graph_in_reduce_overhead_mode_replays_and_keeps_what_the_client_holds(monkeypatch):
    # Inductor is not the point here: the graph's own fx module stands in for its compiled form
    monkeypatch.setattr("torch._inductor.compile", lambda gm, examples, options=None: gm)
    ops = {i: type("R", (), {"name": str(op), "op": op})()
           for i, op in enumerate((torch.ops.aten.mm.default, torch.ops.aten.sum.default), start=1)}
    graphs = Graphs(HandleTable([torch.device("cpu")]), ops.__getitem__, on_gpu=True, capturer=FakeCapturer())
    info = _train_like(graphs, torch.device("cpu"))
    assert info["backend"] == "inductor (reduce-overhead, CUDA graphs)" and info["error"] is None, info
    assert info["cuda_graphs"] == {"captures": 1, "recaptures": 0, "replays": 6 - WARM_CALLS,
                                   "evictions": 6 - WARM_CALLS - 1}, info


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU: Inductor and torch.cuda.CUDAGraph")
def test_on_a_gpu_a_shipped_graph_replays_as_a_cuda_graph_and_keeps_what_the_client_holds():
    from rgpu.server.ops.resolve import resolve

    ops = {i: resolve(name, str(op._schema), "cuda") for i, (name, op) in enumerate(
        (("mm.default", torch.ops.aten.mm.default), ("sum.default", torch.ops.aten.sum.default)), start=1)}
    device = torch.device("cuda", 0)
    graphs = Graphs(HandleTable([device]), ops.__getitem__, on_gpu=True)  # the real CudaCapturer
    info = _train_like(graphs, device)
    assert info["backend"] == "inductor (reduce-overhead, CUDA graphs)" and info["error"] is None, info
    assert info["cuda_graphs"] == {"captures": 1, "recaptures": 0, "replays": 6 - WARM_CALLS,
                                   "evictions": 6 - WARM_CALLS - 1}, info


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_modes_that_do_not_ask_for_cuda_graphs_get_no_replayer(monkeypatch, mode):
    monkeypatch.setattr("torch._inductor.compile", lambda gm, examples, options=None: gm)
    ops = {1: type("R", (), {"name": "aten.add.Tensor", "op": torch.ops.aten.add.Tensor})()}
    graphs = Graphs(HandleTable([torch.device("cpu")]), ops.__getitem__, on_gpu=True, capturer=FakeCapturer())
    graphs.define([11, 1, {"mode": mode}, {"inputs": 2, "nodes": [[1, [{"n": 0}, {"n": 1}], {}]], "outputs": [2]}],
                  [])
    g = graphs.graphs[1]
    g.run([torch.ones(2), torch.ones(2)])
    assert g.replayer is None and g.label() == f"inductor ({mode})"


def add_scaled(w, x, s):
    return (x + w * s,)


@pytest.mark.parametrize("inputs, why", [
    (lambda: [torch.randn(3, 4), torch.randn(3, 4), 1.0], "input 0 is a cpu tensor"),  # to a "cuda" capturer
    (lambda: [torch.randn(3, 4), torch.randn(1, 4).expand(3, 4), 1.0],  # elements that overlap, moving
     "capture failed: RuntimeError: unsupported operation"),
])
def test_a_graph_whose_inputs_cannot_be_captured_runs_without_cuda_graphs_and_says_why(inputs, why):
    r, _ = _replayer(add_scaled)
    if "cpu" in why:
        r.capturer.device_type = "cuda"
    for _ in range(WARM_CALLS + 2):
        args = inputs()
        _same(r(args), add_scaled(*args))
    assert r.reason.startswith(why) and r.replays == 0, r.reason


def _mm_graphs(monkeypatch):
    monkeypatch.setattr("torch._inductor.compile", lambda gm, examples, options=None: gm)
    ops = {1: type("R", (), {"name": "aten.mm.default", "op": torch.ops.aten.mm.default})()}
    graphs = Graphs(HandleTable([torch.device("cpu")]), ops.__getitem__, on_gpu=True, capturer=FakeCapturer())
    graphs.define([11, 1, {"mode": "reduce-overhead"}, {"inputs": 2, "nodes": [[1, [{"n": 0}, {"n": 1}], {}]],
                                                        "outputs": [2]}], [])
    return graphs


F32 = CODE_BY_DTYPE[torch.float32]
W_DESC = [1, 48, F32, [4, 3], [3, 1], 0, 0]   # the weight of _mm_graphs' tests, stable from call to call


def _mm_graphs_counting_lookups(monkeypatch):
    """_mm_graphs, the ids whose tensor the handle table builds (listed in ``built``), its own tensor()."""
    graphs = _mm_graphs(monkeypatch)
    built = []
    real = graphs.table.tensor
    monkeypatch.setattr(graphs.table, "tensor", lambda desc, ptrs=None: built.append(desc[0]) or real(desc, ptrs))
    return graphs, built, real


def test_a_replay_builds_no_view_for_a_stable_input_named_as_it_was_captured(monkeypatch):
    graphs, built, real = _mm_graphs_counting_lookups(monkeypatch)
    f32, w_desc = F32, W_DESC
    with torch.inference_mode():
        w = real(w_desc).copy_(torch.randn(4, 3))
        for step in range(8):
            x_desc = [100 + step, 32, f32, [2, 4], [4, 1], 0, 0]
            x = real(x_desc).copy_(torch.randn(2, 4))
            built.clear()
            graphs.run([12, [], 1, [x_desc, w_desc], [[200 + step, 24, f32, [2, 3], [3, 1], 0, 0]]], [])
            torch.testing.assert_close(real([200 + step, 24, f32, [2, 3], [3, 1], 0, 0]), x @ w)
            if step > WARM_CALLS:   # replays: only the batch is looked up
                assert built == [100 + step], built


def test_a_stable_input_whose_id_names_new_memory_is_noticed_and_its_values_used(monkeypatch):
    graphs = _mm_graphs(monkeypatch)
    f32 = CODE_BY_DTYPE[torch.float32]
    w_desc, x_desc = [1, 48, f32, [4, 3], [3, 1], 0, 0], [2, 32, f32, [2, 4], [4, 1], 0, 0]
    out = [3, 24, f32, [2, 3], [3, 1], 0, 0]
    with torch.inference_mode():
        x = graphs.table.tensor(x_desc).copy_(torch.randn(2, 4))
        graphs.table.tensor(w_desc).copy_(torch.randn(4, 3))
        for _ in range(WARM_CALLS + 2):
            graphs.run([12, [], 1, [x_desc, w_desc], [out]], [])
        w2 = torch.randn(4, 3)
        graphs.table.bind(1, w2.clone().untyped_storage(), 0)   # the same id and layout, other memory
        for _ in range(3):
            graphs.run([12, [], 1, [x_desc, w_desc], [out]], [])
            torch.testing.assert_close(graphs.table.tensor(out), x @ w2)
    assert graphs.graphs[1].replayer.recaptures == 1


def test_a_stable_input_named_by_a_new_id_at_the_captured_address_is_taken_as_captured(monkeypatch):
    # the forward's saved activations: CUDA graph outputs that the client names anew at every call
    graphs, built, real = _mm_graphs_counting_lookups(monkeypatch)
    f32 = F32
    with torch.inference_mode():
        w = real(W_DESC).copy_(torch.randn(4, 3))
        x_storage = torch.randn(2, 4).untyped_storage()
        for step in range(8):
            x_sid = 100 + step
            graphs.table.bind(x_sid, x_storage, 0)   # a new id, the same memory
            x_desc = [x_sid, 32, f32, [2, 4], [4, 1], 0, 0]
            built.clear()
            out = [200 + step, 24, f32, [2, 3], [3, 1], 0, 0]
            graphs.run([12, [], 1, [x_desc, W_DESC], [out]], [])
            torch.testing.assert_close(real(out), real(x_desc) @ w)
            if step > WARM_CALLS:
                assert built == [], built   # neither input looked up
        # the same memory in another layout is not the captured input: looked up, and its values used
        built.clear()
        x_t = [300, 32, f32, [2, 4], [1, 2], 0, 0]
        graphs.table.bind(300, x_storage, 0)
        graphs.run([12, [], 1, [x_t, W_DESC], [[301, 24, f32, [2, 3], [3, 1], 0, 0]]], [])
        assert 300 in built
        torch.testing.assert_close(real([301, 24, f32, [2, 3], [3, 1], 0, 0]), real(x_t) @ w)
