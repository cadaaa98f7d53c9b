"""The C++ fast path in a session of several servers: each op posted from C++ to its device's server.

Two CPU servers on loopback with two devices each (rgpu:0..3), as in test_multi_server.py.
Each client runs in a fresh interpreter; values are compared with the CPU's, value by value,
and the fast path's own counters (``C.fast_path_stats()``: posts per server) say C++ posted them.
"""
from __future__ import annotations

import pytest

from conftest import RunningServer
from test_multi_server import FLAGS, _client

FAST = r"""
import json, torch, rgpu
from rgpu.device_backend import session
out = {}
a = torch.linspace(-2, 2, 24).reshape(4, 6)
b = torch.arange(6.0)

def chain(x, y):
    h = (x.relu() * y + 1).softmax(-1) @ x.t()
    return (h.tanh() - x.mean()).sum(0) * 3

ref = chain(a, b)
torch.ones(1, device="rgpu")
C = session.current().C
out["servers"] = len(C.fast_path_stats()["posts"])
rounds = []
for r in range(3):
    if r == 1:   # the first round taught C++ the plans, on each server
        C.fast_path_stats(reset=True)
    rounds.append([torch.equal(chain(a.to(f"rgpu:{d}"), b.to(f"rgpu:{d}")).cpu(), ref) for d in range(4)])
out["ops"] = rounds
out["steady"] = C.fast_path_stats(reset=True)

torch.rgpu.set_device(3)   # no tensor argument: the current device's server
fill = [torch.full((5,), 2.5, device="rgpu").exp().cpu() for _ in range(3)]
out["current_device_ops"] = all(torch.equal(f, torch.full((5,), 2.5).exp()) for f in fill)
out["current_device_stats"] = C.fast_path_stats(reset=True)
torch.rgpu.set_device(0)

torch.rgpu.synchronize()
held = [torch.rgpu.memory_allocated(d) for d in range(4)]
for _ in range(4):   # grown and freed on rgpu:3 from C++: the frees reach its server
    t = torch.ones(1 << 18, device="rgpu:3") * 2
    del t
torch.rgpu.synchronize()
out["memory_after_frees"] = [torch.rgpu.memory_allocated(d) - held[d] for d in range(4)]

def split(devices):   # a model cut in two, one half per server: activations and gradients cross between them
    torch.manual_seed(0)
    first, second = torch.nn.Linear(6, 16).to(devices[0]), torch.nn.Linear(16, 3).to(devices[1])
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    losses = []
    for step in range(6):
        if step == 2:
            C.fast_path_stats(reset=True)
        x = torch.randn(8, 6, generator=g).to(devices[0])
        y = torch.randint(0, 3, (8,), generator=g).to(devices[1])
        loss = torch.nn.functional.cross_entropy(second(first(x).tanh().to(devices[1])), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in (*first.parameters(), *second.parameters())]

cpu_split = split(["cpu", "cpu"])
rgpu_split = split(["rgpu:1", "rgpu:2"])
out["train_stats"] = C.fast_path_stats(reset=True)
out["split_losses"] = [cpu_split[0], rgpu_split[0]]
out["split_params_equal"] = all(torch.equal(p, q) for p, q in zip(cpu_split[1], rgpu_split[1]))

x, z = a.to("rgpu:0"), a.to("rgpu:3")
for _ in range(2):
    x + x          # the plan of rgpu:0 + rgpu:0 is C++'s now
refusals = {}
for name, op in {"add": lambda: x + z, "add_": lambda: x.add_(z), "mm": lambda: x @ z.t(),
                 "call": lambda: x[(z > 0)]}.items():
    try:
        op()
        refusals[name] = None
    except RuntimeError as exc:
        refusals[name] = str(exc).splitlines()[0]
out["refusals"] = refusals
out["x_unchanged"] = torch.equal(x.cpu(), a)
guard = {}
for name, op in {"set_device": lambda: torch.rgpu.set_device(4), "factory": lambda: torch.ones(1, device="rgpu:5")}.items():
    try:
        op()
        guard[name] = None
    except RuntimeError as exc:
        guard[name] = str(exc).splitlines()[0]
out["guard"] = guard
try:
    session.current().servers.of(6)
except RuntimeError as exc:
    out["python_message"] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = [RunningServer(tmp_path_factory.mktemp(f"server{i}"), FLAGS) for i in range(2)]
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def fast(servers):
    return _client(FAST, servers)


@pytest.fixture(scope="module")
def python_path(servers):
    return _client(FAST, servers, RGPU_NATIVE="off")


def test_with_two_servers_the_fast_path_posts_each_op_to_its_devices_server(fast):
    assert fast["servers"] == 2
    steady = fast["steady"]
    # two rounds over rgpu:0..3: every op a hit, C++'s posts split between both servers
    assert steady["misses"] == 0 and steady["hits"] >= 2 * 4 * 8, steady
    assert steady["posts"][0] > 0 and steady["posts"][0] == steady["posts"][1], steady
    assert steady["uploads"] == 2 * 4 * 2, steady


def test_ops_on_every_servers_devices_from_cpp_match_the_cpu_value_by_value(fast):
    assert fast["ops"] == [[True] * 4] * 3


def test_an_op_without_tensors_goes_to_the_current_devices_server(fast):
    assert fast["current_device_ops"]
    stats = fast["current_device_stats"]
    assert stats["hits"] >= 4 and stats["posts"][0] == 0 and stats["posts"][1] > 0, stats


def test_frees_from_cpp_reach_the_server_that_holds_the_storage(fast):
    assert fast["memory_after_frees"] == [0, 0, 0, 0]


def test_a_model_cut_across_two_servers_trains_from_cpp_as_on_the_cpu(fast):
    cpu, remote = fast["split_losses"]
    assert remote == cpu
    assert fast["split_params_equal"]
    stats = fast["train_stats"]
    assert stats["hits"] > 0 and stats["posts"][0] > 0 and stats["posts"][1] > 0, stats


def test_an_op_mixing_two_servers_devices_is_refused_as_on_the_python_path(fast, python_path):
    refusals = fast["refusals"]
    assert refusals == python_path["refusals"]
    for name in ("add", "add_", "mm"):
        assert "rgpu:0" in refusals[name] and "rgpu:3" in refusals[name], refusals
    assert refusals["call"] is not None
    assert fast["x_unchanged"]


def test_an_out_of_range_device_names_every_servers_count(fast):
    want = "rgpu:4 does not exist (the servers have 4 devices)"
    assert want in fast["guard"]["set_device"], fast["guard"]
    assert "rgpu:5 does not exist (the servers have 4 devices)" in fast["guard"]["factory"], fast["guard"]
    assert fast["python_message"] == "rgpu:6 does not exist (the servers have 4 devices)"


COMPILED = r"""
import json, warnings, torch, rgpu
from rgpu.device_backend import compile as rcompile
out = {}

def train(device, compiled):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_model = torch.compile(model, backend="rgpu") if compiled else model
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(8, 6, generator=g).to(device)
        y = torch.randint(0, 3, (8,), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(step_model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]

torch.ones(1, device="rgpu")   # the session first: autograd sizes its device queues at its first backward
cpu = train("cpu", False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for device in ("rgpu:0", "rgpu:3"):   # one graph pair per server: shipped to the server holding it
        before = rcompile.stats()
        torch._dynamo.reset()
        got = train(device, True)
        after = rcompile.stats()
        out[device] = {"losses": got[0], "params": all(torch.allclose(p, q, rtol=1e-6, atol=1e-6)
                                                       for p, q in zip(cpu[1], got[1])),
                       "shipped": after["graphs_shipped"] - before["graphs_shipped"],
                       "eager": after["graphs_eager"] - before["graphs_eager"]}
    out["cpu_losses"] = cpu[0]

    def crossing(x, w):     # tensors of both servers in one graph: eager, op by op
        return ((x * 2).to("rgpu:2") @ w).relu()

    x, w = torch.randn(4, 5), torch.randn(5, 3)
    before = rcompile.stats()
    torch._dynamo.reset()
    got = torch.compile(crossing, backend="rgpu")(x.to("rgpu:1"), w.to("rgpu:2"))
    after = rcompile.stats()
    out["crossing"] = {"equal": torch.equal(got.cpu(), ((x * 2) @ w).relu()),
                       "eager": after["graphs_eager"] - before["graphs_eager"],
                       "shipped": after["graphs_shipped"] - before["graphs_shipped"]}
out["warnings"] = [str(w.message) for w in caught if "rgpu" in str(w.message)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled(servers):
    return _client(COMPILED, servers)


def test_a_compiled_model_is_shipped_to_the_server_of_its_devices_and_trains_as_on_the_cpu(compiled):
    for device in ("rgpu:0", "rgpu:3"):
        got = compiled[device]
        assert got["shipped"] >= 2 and got["eager"] == 0, compiled   # forward and backward graphs
        assert got["losses"] == pytest.approx(compiled["cpu_losses"], rel=1e-6, abs=1e-6)
        assert got["params"]


def test_a_graph_whose_tensors_are_on_two_servers_runs_eagerly_with_the_reason(compiled, servers):
    crossing = compiled["crossing"]
    assert crossing["equal"] and crossing["eager"] >= 1 and crossing["shipped"] == 0, compiled
    said = [w for w in compiled["warnings"] if "several servers' devices" in w]
    assert said and all(s.address in said[0] for s in servers), compiled["warnings"]
