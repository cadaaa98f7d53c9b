"""Clients killed at random moments: their sessions all end, and a session that trains all along is unaffected.

The victims are raw protocol clients in processes of their own (no torch: the ops route's uploads and
downloads, the cuda route's allocations and copies on the fake driver, the echo route's calls; CI's
run leaves the ops route to the full one, whose workers import torch), started while at most
``ALIVE`` live and killed (SIGKILL) at a random moment: before they connect, mid-handshake, mid-upload.
The trainer is a least-squares fit by gradient steps, run as aten ops over the ops route and checked,
step by step, against the same ops on the CPU here.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from rgpu.protocol.ops import DTYPES, Event, Msg

from conftest import clean_env, wait_until
from device_helpers import ROOT

ALIVE = 10
ROUTES = ("ops", "cuda", "echo")
F32 = DTYPES.index("float32")
aten = torch.ops.aten

VICTIM = r'''
import random, sys
import numpy as np
from rgpu.transport.client import connect
from rgpu.protocol.ops import DTYPES, Msg
assert "torch" not in sys.modules
F32 = DTYPES.index("float32")
route = sys.argv[1]
conn = connect(route)
print("up", flush=True)
if route == "ops":
    sid = 1
    while True:
        n = random.randint(1, 1 << 18)
        desc = [sid, 4 * n, F32, [n], [1], 0, 0]
        conn.post([Msg.UPLOAD, [], desc], [np.full(n, sid, dtype=np.float32)])
        if sid % 4 == 0:
            conn.call([Msg.DOWNLOAD, [], desc]).release()
        sid += 1
elif route == "echo":
    while True:
        n = random.randint(1, 1 << 18)
        conn.post({"op": "sizes"}, [bytes(n)])
        assert conn.call({"op": "echo"}, [b"x" * n]).buffers[0].nbytes == n
else:
    def call(op, ctx, *args, buffers=()):
        code, value, _ = conn.call([op, ctx, *args], list(buffers)).meta
        assert code == 0, (op, value)
        return value
    call("init", 0, 0)
    ctx = call("primary_ctx_retain", 0, 0)
    held = []
    while True:
        n = random.randint(1, 1 << 18)
        ptr = call("mem_alloc", ctx, n)
        call("memcpy_htod", ctx, ptr, None, buffers=[b"v" * n])
        held.append(ptr)
        if len(held) > 8:
            call("mem_free", ctx, held.pop(0))
'''


def _workers(server) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _desc(sid: int, t: torch.Tensor) -> list:
    return [sid, t.numel() * 4, F32, list(t.shape), list(t.stride()), 0, 0]


class Trainer:
    """w <- w - lr * x^T (x w - y), each step three aten ops over the ops route; ``reference`` on the CPU."""

    OPS = {1: aten.mm.default, 2: aten.sub.Tensor}

    def __init__(self, conn, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.conn = conn
        self.x = torch.randn(16, 8, generator=g)
        self.xt = self.x.t().contiguous()
        self.y = torch.randn(16, 1, generator=g)
        self.w = torch.zeros(8, 1)
        self.lr = 0.01
        for index, op in self.OPS.items():
            conn.post([Msg.DEFINE, index, f"{op._schema.name[6:]}.{op._overloadname}", str(op._schema)])
        for sid, t in ((1, self.x), (2, self.xt), (3, self.y), (4, self.w)):
            conn.post([Msg.UPLOAD, [], _desc(sid, t)], [t.numpy()])
        self.sid_w, self.next_sid, self.steps = 4, 100, 0
        self.expected = self.w.clone()    # the same steps on the CPU here

    def _op(self, index, args, kwargs, out_sid, like) -> list:
        out = _desc(out_sid, like)
        self.conn.post([Msg.OP, [], index, args, kwargs, [out]])
        return out

    def step(self) -> None:
        s = self.next_sid
        self.next_sid += 3
        w = {"t": _desc(self.sid_w, self.w)}
        pred = self._op(1, [{"t": _desc(1, self.x)}, w], {}, s, self.y)
        err = self._op(2, [{"t": pred}, {"t": _desc(3, self.y)}], {}, s + 1, self.y)
        grad = self._op(1, [{"t": _desc(2, self.xt)}, {"t": err}], {}, s + 2, self.w)
        new = self._op(2, [w, {"t": grad}], {"alpha": self.lr}, s + 3, self.w)
        self.conn.post([Msg.EVENTS, [Event.FREE, self.sid_w, Event.FREE, s, Event.FREE, s + 1, Event.FREE, s + 2]])
        self.sid_w = new[0]
        self.next_sid += 1
        self.steps += 1
        e = self.expected
        self.expected = torch.sub(e, torch.mm(self.xt, torch.sub(torch.mm(self.x, e), self.y)), alpha=self.lr)

    def weights(self) -> torch.Tensor:
        reply = self.conn.call([Msg.DOWNLOAD, [], _desc(self.sid_w, self.w)])
        out = torch.frombuffer(bytearray(reply.buffers[0]), dtype=torch.float32).reshape(8, 1)
        reply.release()
        return out

    def held_bytes(self) -> int:
        return self.conn.call([Msg.MEMORY, 0]).meta[0]

    def reference(self) -> torch.Tensor:
        return self.expected


class Victim:
    """One raw client process; killed ``delay`` seconds after it starts or, when ``after_up``, after it connected."""

    def __init__(self, route: str, env: dict, delay: float, after_up: bool):
        self.proc = subprocess.Popen([sys.executable, "-c", VICTIM, route], env=env, cwd=str(ROOT),
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.started, self.delay, self.after_up = time.monotonic(), delay, after_up
        self.up: float | None = None

    def due(self, now: float) -> bool:
        if self.up is None and (self.proc.stdout.read() or b"").startswith(b"up"):
            self.up = now
        if self.proc.poll() is not None:
            return True
        if self.after_up:
            return self.up is not None and now >= self.up + self.delay
        return now >= self.started + self.delay

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()


def _victims(server, total: int, rng: random.Random, weights: tuple) -> dict:
    env = clean_env(RGPU_SERVER=server.address, RGPU_TOKEN=server.token, RGPU_TRANSPORT="tcp",
                    RGPU_CONNECT_TIMEOUT="60")
    alive: list[Victim] = []
    counts = {"started": 0, "killed before up": 0, "killed up": 0, "exited by itself": 0, "most alive": 0}
    while counts["started"] < total or alive:
        now = time.monotonic()
        for v in [v for v in alive if v.due(now)]:
            exited = v.proc.poll() is not None
            v.kill()
            alive.remove(v)
            counts["exited by itself" if exited else "killed up" if v.up is not None else "killed before up"] += 1
        if counts["started"] < total and len(alive) < ALIVE:
            after_up = rng.random() < 0.75      # most mid-session; the others anywhere from start to handshake
            alive.append(Victim(rng.choices(ROUTES, weights)[0], env,
                                rng.uniform(0.0, 1.0 if after_up else 3.0), after_up))
            counts["started"] += 1
            counts["most alive"] = max(counts["most alive"], len(alive))
        time.sleep(0.02)
    return counts


def _killed_clients_leave_nothing_behind(start_server, total: int, weights: tuple) -> None:
    """``weights``: how often a victim takes each of ``ROUTES`` (an ops session's worker imports torch: seconds)."""
    # A victim is killed outright (SIGKILL: no goodbye), so its session is held for the grace in case it comes
    # back: a short one here, so each ends almost with its process, as this test checks
    server = start_server("--device", "cpu", "--cuda-driver", "fake", "--spare-workers", "3", "--session-grace", "0.5")
    trainer = Trainer(server.connect("ops"))
    trainer.step()
    held = trainer.held_bytes()
    baseline = _workers(server)
    stop, failures = threading.Event(), []

    def train() -> None:
        try:
            while not stop.is_set():
                trainer.step()
                if trainer.steps % 10 == 0:
                    assert torch.equal(trainer.weights(), trainer.reference()), f"step {trainer.steps}"
                time.sleep(0.02)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        counts = _victims(server, total, random.Random(total), weights)
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures
    assert counts["most alive"] <= ALIVE and counts["killed up"] > total // 2 and not counts["exited by itself"], counts
    # every victim's session ends with its process: the server is back to the trainer's session and its spares
    wait_until(lambda: len(_workers(server)) <= len(baseline), 30, f"the victims' sessions to end ({counts})")
    assert trainer.steps > 10
    assert torch.equal(trainer.weights(), trainer.reference())
    assert trainer.held_bytes() == held     # its handle table holds what it held, no more
    assert "Traceback" not in server.stderr


def test_thirty_killed_raw_clients_leave_no_session_behind_and_the_training_session_is_unaffected(start_server):
    _killed_clients_leave_nothing_behind(start_server, 30, (0.0, 0.6, 0.4))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RGPU_FULL_RESILIENCE") != "1",
                    reason="the full run (100 clients, minutes on 2 cores): RGPU_FULL_RESILIENCE=1 RGPU_TEST_WATCHDOG=1200")
def test_a_hundred_killed_raw_clients_leave_no_session_behind_and_the_training_session_is_unaffected(start_server):
    _killed_clients_leave_nothing_behind(start_server, 100, (0.4, 0.4, 0.2))
