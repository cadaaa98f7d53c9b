"""The "rgpu" torch.distributed backend: collectives on the servers (gloo among CPU servers), DDP unchanged.

Two ``rgpu serve`` on loopback, two rank processes (``distributed_rank.py``), each on its own
server (and both on one), and one client of both servers with a thread per device
(``distributed_threads.py``). Every value is checked against the CPU computing the same thing here.
The two-server run ends by killing rank 1's server: rank 0 must hear, naming it, within seconds.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import TOKEN, RunningServer, clean_env
from distributed_data import STEPS, batch, inputs, model

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch has no torch.distributed with gloo")

HERE = Path(__file__).parent
WORLD = 2
KILL_NOTICE_S = 10.0  # a dead peer server is named within this (gloo sees its sockets close)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(servers: list[RunningServer], scenarios: str, workdir: Path, on_ready=None,
           backend: str = "rgpu") -> list[dict]:
    """Run the ranks (rank r on ``servers[r % len(servers)]``) to the end; their results."""
    port, outs, procs = _free_port(), [workdir / f"rank{r}.pt" for r in range(WORLD)], []
    for r in range(WORLD):
        env = clean_env(RGPU_SERVER=servers[r % len(servers)].address, RGPU_TOKEN=TOKEN, RGPU_TRANSPORT="tcp",
                        RGPU_COLLECTIVE_TIMEOUT="30", RGPU_CONNECT_TIMEOUT="60", RANK=str(r), WORLD_SIZE=str(WORLD),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(HERE), DIST_BACKEND=backend)
        log = open(workdir / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "distributed_rank.py"), scenarios, str(outs[r])],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        if on_ready is not None:
            ready = Path(f"{outs[0]}.ready")
            deadline = time.monotonic() + 120
            while not ready.exists():
                assert time.monotonic() < deadline and procs[0].poll() is None, (workdir / "rank0.log").read_text()
                time.sleep(0.05)
            on_ready()
        # after a kill only rank 0 is awaited: rank 1's client may try to resume its lost session for long
        for r, p in enumerate(procs[:1] if on_ready is not None else procs):
            assert p.wait(120) == 0, (workdir / f"rank{r}.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [torch.load(out) for out in outs]


@pytest.fixture(scope="module")
def two_servers_run(tmp_path_factory):
    """Collectives, then DDP, then server 1 killed: both ranks' results and the moment of the kill."""
    work = tmp_path_factory.mktemp("dist-two")
    servers = [RunningServer(work / f"server{i}") for i in range(WORLD)]
    killed = {}

    def kill_server_1():
        killed["at"] = time.time()
        os.killpg(servers[1].proc.pid, signal.SIGKILL)  # the server and its session workers: the host gone
        servers[1].proc.wait()

    try:
        results = _ranks(servers, "collectives,ddp,kill", work, on_ready=kill_server_1)
    finally:
        for s in servers:
            s.stop()
    return results, killed["at"], servers


@pytest.fixture(scope="module")
def one_server_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dist-one")
    server = RunningServer(work / "server")
    try:
        return _ranks([server], "collectives,stall", work, backend="cpu:gloo,rgpu:rgpu")  # the mixed form's string
    finally:
        server.stop()


@pytest.fixture(scope="module")
def one_client_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dist-threads")
    servers = [RunningServer(work / f"server{i}") for i in range(WORLD)]
    try:
        env = clean_env(RGPU_SERVER=",".join(s.address for s in servers), RGPU_TOKEN=TOKEN, RGPU_TRANSPORT="tcp",
                        RGPU_CONNECT_TIMEOUT="60",
                        PYTHONPATH=str(HERE))
        done = subprocess.run([sys.executable, str(HERE / "distributed_threads.py"), str(work / "out.pt")],
                              env=env, capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(work / "out.pt")
    finally:
        for s in servers:
            s.stop()


def _full_batch_training(steps: int, last_in_two: bool) -> torch.nn.Module:
    """The reference: the same model trained on the CPU on each step's full batch."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs, ys = batch()
    rows = xs.shape[1] // WORLD
    for step in range(steps):
        opt.zero_grad()
        x, y = xs[step], ys[step]
        if last_in_two and step == steps - 1:  # the ranks' two micro-batches (the first under no_sync)
            half = rows // 2
            first = torch.cat([torch.arange(r * rows, r * rows + half) for r in range(WORLD)])
            second = torch.cat([torch.arange(r * rows + half, (r + 1) * rows) for r in range(WORLD)])
            loss = sum(torch.nn.functional.mse_loss(net(x[i]), y[i]) for i in (first, second))
        else:
            loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
    return net


def _reference(rank: int) -> dict:
    """What each collective gives rank ``rank``, computed on the CPU from every rank's inputs."""
    x = [inputs(r) for r in range(WORLD)]
    want = {}
    for k in ("f", "i"):
        stacked = torch.stack([xi[k] for xi in x])
        want[f"all_reduce/sum/{k}"] = stacked.sum(0)
        want[f"all_reduce/max/{k}"] = stacked.amax(0)
        want[f"all_reduce/min/{k}"] = stacked.amin(0)
        total = stacked.sum(0)
        want[f"all_reduce/avg/{k}"] = total / WORLD if k == "f" else torch.div(total, WORLD, rounding_mode="trunc")
    want["all_reduce/product/p"] = torch.stack([xi["p"] for xi in x]).prod(0)
    want["broadcast"] = x[1]["f"]
    want["all_gather"] = [xi["f"] for xi in x]
    want["all_gather_into_tensor"] = torch.cat([xi["big"] for xi in x])
    mine = sum(xi["big"].chunk(WORLD)[rank] for xi in x)
    want["reduce_scatter"] = mine
    want["reduce_scatter_tensor/avg"] = mine / WORLD
    want["all_reduce/cpu"] = sum(xi["f"] for xi in x)
    return want


def _check_collectives(results: list[dict]) -> None:
    for rank, got in enumerate(r["collectives"] for r in results):
        for key, want in _reference(rank).items():
            # two operands: every order of the reduction gives the same bits, so equal value by value
            torch.testing.assert_close(got[key], want, rtol=0, atol=0, msg=lambda m: f"rank {rank} {key}: {m}")
            if key.startswith("all_reduce/") and key != "all_reduce/cpu":
                torch.testing.assert_close(got[f"{key}/future"], want, rtol=0, atol=0)


def test_every_collective_across_two_servers_matches_the_cpu(two_servers_run):
    _check_collectives(two_servers_run[0])


def test_every_collective_of_two_ranks_on_one_server_matches_the_cpu(one_server_run):
    _check_collectives(one_server_run)


def test_an_unsupported_collective_or_reduce_op_is_refused_by_name(one_server_run):
    got = one_server_run[0]["collectives"]
    assert got["refused/reduce"] is not None and "reduce is not supported" in got["refused/reduce"]
    assert got["refused/band"] is not None and "reduce op BAND is not supported" in got["refused/band"]


def test_ddp_on_two_servers_trains_as_one_cpu_on_the_full_batch(two_servers_run):
    results = [r["ddp"] for r in two_servers_run[0]]
    net = _full_batch_training(STEPS, last_in_two=True)
    for rank, got in enumerate(results):
        for want, have in zip(net.parameters(), got["params"]):
            torch.testing.assert_close(have, want.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: {m}")


def test_gradients_never_cross_the_client(two_servers_run):
    for got in (r["ddp"] for r in two_servers_run[0]):
        batch_bytes = 2 * 8 * 64 * 4  # the rank's inputs and targets, uploaded each step
        for sent, received in zip(got["bytes_out"], got["bytes_in"]):
            # the step's tensor bytes each way: the batch up, the loss down; the gradients are 132 KB
            assert sent <= batch_bytes + 256 and received <= 256, (sent, received, got["grad_bytes"])
        assert got["grad_bytes"] > 30 * batch_bytes


def test_a_killed_server_is_named_to_the_other_rank_within_seconds(two_servers_run):
    results, killed_at, servers = two_servers_run
    got = results[0]["kill"]
    assert got["error"] is not None, "rank 0 went on for a minute after rank 1's server died"
    assert got["at"] - killed_at < KILL_NOTICE_S, got
    assert f"rank 1's server {servers[1].address} does not answer" in got["error"], got["error"]
    assert "all_reduce" in got["error"]


def test_one_client_trains_ddp_on_two_servers_devices_one_thread_each(one_client_run):
    got = one_client_run
    assert not [k for k in got if k.startswith("error/")], {k: v for k, v in got.items() if k.startswith("error/")}
    want = sum(inputs(r)["f"] for r in range(WORLD))
    net = _full_batch_training(2, last_in_two=False)
    for r in range(WORLD):
        torch.testing.assert_close(got[f"all_reduce/{r}"], want, rtol=0, atol=0)
        for ref, have in zip(net.parameters(), got[f"params/{r}"]):
            torch.testing.assert_close(have, ref.detach(), rtol=1e-5, atol=1e-6)


def test_a_rank_that_never_comes_fails_the_others_after_the_groups_timeout(one_server_run):
    got = one_server_run[0]["stall"]
    assert got["error"] is not None, "rank 0's all_reduce finished without rank 1"
    assert "all_reduce on the servers' gloo group (rank 0 of 2) failed" in got["error"], got["error"]
    assert 2.5 < got["after"] < 3 + 6, got  # new_group's 3 s, the peers probed, a margin for a loaded machine
