"""Several servers, one client: ``RGPU_SERVER=a,b`` makes every server's devices rgpu:0..N-1.

Two CPU servers on loopback with two devices each (rgpu:0..3). Each client runs in
a fresh interpreter (the device session is process-wide), against the CPU as the
reference, value by value.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import TOKEN, RunningServer, clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("--device", "cpu", "--devices", "2", "--session-grace", "0")


def _client(code: str, servers, **env) -> dict:
    """Run ``code`` against ``servers`` in a fresh interpreter; what it printed last, as JSON."""
    full = clean_env(RGPU_SERVER=",".join(s.address for s in servers), RGPU_TOKEN=TOKEN, RGPU_TRANSPORT="tcp",
                     **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=full,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = [RunningServer(tmp_path_factory.mktemp(f"server{i}"), FLAGS) for i in range(2)]
    yield started
    for s in started:
        s.stop()


MAIN = r"""
import json, torch, rgpu
out = {}
out["count"] = torch.rgpu.device_count()
a = torch.linspace(-2, 2, 24).reshape(4, 6)
b = torch.arange(6.0)
ref = (a.relu() * b + 1).softmax(-1) @ a.t()
out["ops"] = [torch.equal(((a.to(f"rgpu:{d}").relu() * b.to(f"rgpu:{d}") + 1).softmax(-1)
                           @ a.to(f"rgpu:{d}").t()).cpu(), ref) for d in range(4)]
out["devices"] = [str((a.to(f"rgpu:{d}") + 1).device) for d in range(4)]
torch.rgpu.set_device(2)
out["current"] = [torch.rgpu.current_device(), str(torch.ones(2, device="rgpu").device)]
with torch.rgpu.device(3):
    out["guarded"] = str(torch.zeros(1, device="rgpu").device)
out["after_guard"] = torch.rgpu.current_device()
torch.rgpu.set_device(0)
torch.rgpu.synchronize()
held = [torch.rgpu.memory_allocated(d) for d in range(4)]
big = torch.ones(1 << 18, device="rgpu:3")          # 1 MiB on rgpu:3 alone
torch.rgpu.synchronize(3)
out["memory_grew"] = [torch.rgpu.memory_allocated(d) - held[d] for d in range(4)]
out["names"] = [torch.rgpu.get_device_name(d) for d in range(4)]
torch.manual_seed(5)
draws = [torch.rand(3, device=f"rgpu:{d}").cpu() for d in (1, 3)]
torch.manual_seed(5)
out["seeded"] = all(torch.equal(torch.rand(3, device=f"rgpu:{d}").cpu(), w) for d, w in zip((1, 3), draws))

def train(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        x = torch.randn(8, 6, generator=g).to(device)
        y = torch.randint(0, 3, (8,), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]

def split(devices):   # a model cut in two, one half per server: activations and gradients cross between them
    torch.manual_seed(0)
    first, second = torch.nn.Linear(6, 16).to(devices[0]), torch.nn.Linear(16, 3).to(devices[1])
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        x = torch.randn(8, 6, generator=g).to(devices[0])
        y = torch.randint(0, 3, (8,), generator=g).to(devices[1])
        loss = torch.nn.functional.cross_entropy(second(first(x).tanh().to(devices[1])), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in (*first.parameters(), *second.parameters())]

cpu_split, rgpu_split = split(["cpu", "cpu"]), split(["rgpu:1", "rgpu:2"])
out["split_losses"] = [cpu_split[0], rgpu_split[0]]
out["split_params_equal"] = all(torch.allclose(p, q, rtol=1e-6, atol=1e-6) for p, q in zip(cpu_split[1], rgpu_split[1]))
cpu_losses, cpu_params = train("cpu")
r_losses, r_params = train("rgpu:3")
out["train_losses"] = [cpu_losses, r_losses]
out["train_params_equal"] = all(torch.allclose(p, q, rtol=1e-6, atol=1e-6) for p, q in zip(cpu_params, r_params))

src = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2))   # 4 MiB
x0 = src.to("rgpu:0")
torch.rgpu.synchronize()
before = rgpu.stats()
x3 = x0.to("rgpu:3")
y1 = (x3 * 1).to("rgpu:1")                # rgpu:3 -> rgpu:1, server to server again
same = x3.to("rgpu:2")                    # rgpu:3 -> rgpu:2: a copy on the second server
half = x3.to(torch.float16).to("rgpu:0")  # converted, then copied across
torch.rgpu.synchronize()
after = rgpu.stats()
out["copy_bytes"] = src.nbytes
out["client_bytes"] = sum(after[k] - before[k] for k in ("bytes_out", "bytes_in"))
out["copies_equal"] = [torch.equal(t.cpu(), src) for t in (x3, y1, same)] + [torch.equal(half.cpu(), src.half())]
view = a.to("rgpu:1")[:, 1::2]
dst = torch.zeros(3, 4, device="rgpu:2").t()
dst.copy_(view)
out["strided_copy"] = torch.equal(dst.cpu(), a[:, 1::2])

x, m = a.to("rgpu:0"), (a > 0).to("rgpu:3")
try:
    x + a.to("rgpu:3")
    out["mixed_op"] = None
except RuntimeError as exc:
    out["mixed_op"] = str(exc)
try:
    x[m]
    out["mixed_call"] = None
except RuntimeError as exc:
    out["mixed_call"] = str(exc)
from rgpu.device_backend import session
out["fast_path"] = session.current().C.fast_path_stats()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def main(servers):
    return _client(MAIN, servers)


def test_the_devices_of_every_server_are_numbered_in_order(main):
    assert main["count"] == 4
    assert main["devices"] == ["rgpu:0", "rgpu:1", "rgpu:2", "rgpu:3"]


def test_ops_on_each_device_match_the_cpu_value_by_value(main):
    assert main["ops"] == [True] * 4


def test_set_device_and_the_device_guard_pick_another_servers_device(main):
    assert main["current"] == [2, "rgpu:2"]
    assert main["guarded"] == "rgpu:3"
    assert main["after_guard"] == 2


def test_memory_names_and_seeds_are_each_devices_own(main):
    assert main["memory_grew"] == [0, 0, 0, 1 << 20]
    assert len(main["names"]) == 4 and all(main["names"])
    assert main["seeded"]


def test_a_model_on_the_second_servers_last_device_trains_as_on_the_cpu(main):
    cpu, remote = main["train_losses"]
    assert remote == pytest.approx(cpu, rel=1e-6, abs=1e-6)
    assert main["train_params_equal"]


def test_a_model_cut_across_two_servers_trains_as_on_the_cpu(main):
    cpu, remote = main["split_losses"]
    assert remote == pytest.approx(cpu, rel=1e-6, abs=1e-6)
    assert main["split_params_equal"]


def test_copies_between_servers_bypass_the_client_and_keep_every_value(main):
    assert main["copies_equal"] == [True] * 4
    assert main["strided_copy"]
    # four copies of 4 MiB (three across servers): the client's connections carried no tensor bytes
    # (their counters count buffers: uploads, downloads), only the messages
    assert main["client_bytes"] < main["copy_bytes"] // 20, main


def test_the_fast_path_streams_from_cpp_to_both_servers(main):
    stats = main["fast_path"]
    assert stats["hits"] > 0 and len(stats["posts"]) == 2 and all(stats["posts"]), stats


def test_an_op_mixing_two_servers_devices_is_refused_naming_both(main):
    assert "rgpu:0" in main["mixed_op"] and "rgpu:3" in main["mixed_op"]
    assert main["mixed_call"] is not None   # a mask on another server's device: PyTorch's own refusal


KILLED = r"""
import json, os, signal, torch, rgpu
from rgpu.device_backend import session
out = {}
x = torch.ones(3, device="rgpu:0")
y = torch.ones(3, device="rgpu:2")
torch.rgpu.synchronize()
os.killpg(int(os.environ["VICTIM_PID"]), signal.SIGKILL)   # the server and its session's worker
import time; time.sleep(1.0)
errors = []
for step in (lambda: (y + 1).cpu(), lambda: torch.rgpu.synchronize(), lambda: (x + 1).cpu()):
    try:
        step()
        errors.append(None)
    except rgpu.RgpuError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
out["errors"] = errors
out["others_alive"] = [srv.conn.alive for srv in session.current().servers.all]
print(json.dumps(out))
"""


def test_a_killed_server_ends_the_session_naming_it_and_the_other_is_released(tmp_path):
    started = [RunningServer(tmp_path / f"s{i}", FLAGS) for i in range(2)]
    try:
        victim = started[1]
        got = _client(KILLED, started, VICTIM_PID=str(victim.proc.pid))
        first, sync, other = got["errors"]
        assert first is not None and victim.address in first, got
        assert "rgpu:2..3" in first and started[0].address in first
        assert sync == first and other == first      # every later use says the same
        assert got["others_alive"] == [False, False]  # the first server's session was closed
    finally:
        for s in started:
            s.stop()


def _push(peers_dst, ticket: bytes, src, host="127.0.0.1"):
    """``src`` sent from a source's Peers, in a thread, to ``peers_dst``'s listener."""
    import threading

    from rgpu.server.ops.peer import Peers

    source = Peers("127.0.0.1", 5.0)
    errors: list = []

    def send():
        try:
            source.send(ticket, host, peers_dst.port, src)
        except Exception as exc:  # seen by the test
            errors.append(exc)
    t = threading.Thread(target=send)
    t.start()
    return t, errors, source


def test_a_peer_transfer_takes_only_its_ticket_and_keeps_one_that_came_early():
    import socket

    import torch

    from rgpu.server.ops.peer import Peers, PeerError

    dst_peers = Peers("127.0.0.1", 5.0)
    try:
        stranger = socket.create_connection(("127.0.0.1", dst_peers.port))
        stranger.sendall(b"x" * 32 + b"B" + (16).to_bytes(8, "big") + b"y" * 16)   # no ticket of ours
        a, b = torch.arange(6.0), torch.arange(4, dtype=torch.int64)
        t1, e1, _ = _push(dst_peers, b"2" * 32, b)     # the later copy's source connects first
        t2, e2, _ = _push(dst_peers, b"1" * 32, a)
        got_a, got_b = torch.zeros(6), torch.zeros(4, dtype=torch.int64)
        dst_peers.receive(b"1" * 32, got_a)
        dst_peers.receive(b"2" * 32, got_b)
        t1.join(5), t2.join(5)
        assert not e1 and not e2
        assert torch.equal(got_a, a) and torch.equal(got_b, b)
        with pytest.raises(PeerError, match="holds"):   # a size the destination does not hold is refused
            t3, _, _ = _push(dst_peers, b"3" * 32, torch.arange(3.0))
            dst_peers.receive(b"3" * 32, torch.zeros(5))
        stranger.close()
    finally:
        dst_peers.close()


def test_a_destination_that_cannot_open_cuda_ipc_handles_takes_the_bytes_instead(monkeypatch):
    import msgpack
    import torch

    from rgpu.server.ops import peer

    monkeypatch.setattr(peer, "_share", lambda src: msgpack.packb([[0, b"handle"], list(src.shape), [1], 0]))
    dst_peers = peer.Peers("127.0.0.1", 5.0)
    try:
        src = torch.linspace(0, 1, 7)
        t, errors, source = _push(dst_peers, b"k" * 32, src)
        got = torch.zeros(7)
        dst_peers.receive(b"k" * 32, got)   # a CPU destination: the IPC offer answered "bytes"
        t.join(5)
        assert not errors and torch.equal(got, src)
        assert (source.ipc, source.tcp) == (0, 1)
    finally:
        dst_peers.close()


def test_rgpu_server_takes_one_address_as_before_or_a_comma_list():
    from rgpu import config
    from rgpu.errors import ConfigError

    one = config.settings(environ={"RGPU_SERVER": "gpu:9000"})
    assert one.server_address() == ("gpu", 9000) and one.server_addresses() == [("gpu", 9000)]
    two = config.settings(environ={"RGPU_SERVER": "a:1, [::1]:2"})
    assert two.server_addresses() == [("a", 1), ("::1", 2)] and two.server_address() == ("a", 1)
    assert config.settings(environ={}).server_addresses() == []
    with pytest.raises(ConfigError, match="named twice"):
        config.parse_addresses("a:1,a:1", "RGPU_SERVER")
    with pytest.raises(ConfigError, match="empty item"):
        config.parse_addresses("a:1,", "--server")


def test_a_server_that_cannot_be_reached_at_the_start_is_named(servers):
    import socket

    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    env = clean_env(RGPU_SERVER=f"{servers[0].address},{dead}", RGPU_TOKEN=TOKEN, RGPU_TRANSPORT="tcp")
    out = subprocess.run([sys.executable, "-c", "import torch, rgpu; torch.ones(1, device='rgpu')"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode != 0
    assert f"server {dead} of RGPU_SERVER" in out.stderr, out.stderr[-2000:]


class _Conn:
    def __init__(self, count):
        self.welcome = {"info": {"device_count": count, "names": [f"d{i}" for i in range(count)]}}
        self.posted: list = []

    def post(self, meta):
        self.posted.append(meta)


class _C:
    def __init__(self):
        self.events: list = []

    def drain_events(self):
        out, self.events = self.events, []
        return out

    def current_device(self):
        return 0


def test_allocator_events_are_split_per_server_and_an_idle_servers_frees_are_bounded():
    import threading

    from rgpu.device_backend import servers as srv
    from rgpu.protocol.ops import Event, Msg

    C = _C()
    s = srv.Servers([_Conn(2), _Conn(2)], C, threading.RLock(), ["a:1", "b:2"])
    a, b = s.all
    assert [s.of(d) for d in range(4)] == [a, a, b, b] and b.devices() == "rgpu:2..3"
    C.events = [Event.FREE, 7, Event.COPY, 9, 64, 3, 8, 32, Event.FREE, 5]
    assert b.events() == [Event.FREE, 7, Event.COPY, 9, 64, 3, 8, 32, Event.FREE, 5]
    assert a.events() == [Event.FREE, 7, Event.FREE, 5]   # a growth on rgpu:3 is b's alone
    C.events = [Event.FREE, 1] * (srv.PENDING_MAX // 2 + 1)
    assert len(a.events()) == srv.PENDING_MAX + 2
    assert b.conn.posted and b.conn.posted[0][0] == Msg.EVENTS and not b.pending   # sent without an op


THROUGH_CLIENT = r"""
import json, torch, rgpu
out = {}
src = torch.randn(1 << 18, generator=torch.Generator().manual_seed(3))   # 1 MiB
x0 = src.to("rgpu:0")
torch.rgpu.synchronize()
before = rgpu.stats()
x3 = x0.to("rgpu:3")                       # across servers, through this process
half = x3.to(torch.float16).to("rgpu:1")   # converted on rgpu:3, then across again
torch.rgpu.synchronize()
after = rgpu.stats()
out["client_bytes"] = sum(after[k] - before[k] for k in ("bytes_out", "bytes_in"))
out["copy_bytes"] = src.nbytes
out["equal"] = [torch.equal(x3.cpu(), src), torch.equal(half.cpu(), src.half())]
view = src[:24].reshape(4, 6).to("rgpu:1")[:, 1::2]
dst = torch.zeros(3, 4, device="rgpu:2").t()
dst.copy_(view)
out["strided"] = torch.equal(dst.cpu(), src[:24].reshape(4, 6)[:, 1::2])
print(json.dumps(out))
"""


def test_with_rgpu_peer_copy_client_copies_between_servers_go_through_the_client_with_every_value(servers):
    """Servers behind SSH tunnels cannot reach each other (``rgpu run --ssh a,b`` sets RGPU_PEER_COPY=client)."""
    got = _client(THROUGH_CLIENT, servers, RGPU_PEER_COPY="client")
    assert got["equal"] == [True, True] and got["strided"], got
    # each copy down and up again: the first (4 bytes an element) both ways, the converted one (2) both ways
    assert got["client_bytes"] >= 2 * got["copy_bytes"] + got["copy_bytes"], got
