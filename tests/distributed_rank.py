"""One rank of test_distributed's runs: ``python tests/distributed_rank.py SCENARIO[,SCENARIO..] OUT``.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RGPU_SERVER, RGPU_TOKEN, DIST_BACKEND
(init_process_group's, default "rgpu"). Writes its
results to OUT (torch.save of {scenario: results}), after each scenario.

    collectives  every supported collective on rgpu tensors (inputs from ``inputs(rank)``), the refusals' messages
    ddp          DDP of a small model for a few steps (one under no_sync), the client's bytes sent per step
    kill         one all_reduce, then "ready"; all_reduce + item() until the servers' group fails: its message, time
    stall        a new group with a 3 s timeout; rank 1 never joins its all_reduce: rank 0's error and how long it took
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

import rgpu  # the device, by the package's own name
import rgpu.distributed  # noqa: F401  (the backend)
import torch.distributed as dist
from distributed_data import STEPS, batch, inputs, model

DEV = "rgpu"
STALL_TIMEOUT_S = 3


def collectives(rank: int, world: int) -> dict:
    x = {k: v.to(DEV) for k, v in inputs(rank).items()}
    out = {}
    for op in ("sum", "avg", "max", "min", "product"):
        for k in (["p"] if op == "product" else ["f", "i"]):
            t = x[k].clone()
            work = dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()), async_op=True)
            work.wait()
            out[f"all_reduce/{op}/{k}"] = t.cpu()
            out[f"all_reduce/{op}/{k}/future"] = work.get_future().value()[0].cpu()
    t = x["f"].clone()
    dist.broadcast(t, src=1)
    out["broadcast"] = t.cpu()
    parts = [torch.empty(6, device=DEV) for _ in range(world)]
    dist.all_gather(parts, x["f"])
    out["all_gather"] = [p.cpu() for p in parts]
    whole = torch.empty(world * 4, 8, device=DEV)
    dist.all_gather_into_tensor(whole, x["big"])
    out["all_gather_into_tensor"] = whole.cpu()
    mine = torch.empty(4 // world, 8, device=DEV)
    dist.reduce_scatter(mine, list(x["big"].chunk(world)))
    out["reduce_scatter"] = mine.cpu()
    mine = torch.empty(4 // world, 8, device=DEV)
    dist.reduce_scatter_tensor(mine, x["big"], op=dist.ReduceOp.AVG)
    out["reduce_scatter_tensor/avg"] = mine.cpu()
    dist.barrier()
    cpu = inputs(rank)["f"]  # a CPU tensor goes through the clients' own gloo group
    dist.all_reduce(cpu)
    out["all_reduce/cpu"] = cpu
    for name, call in (("reduce", lambda: dist.reduce(x["f"], dst=0)),
                       ("band", lambda: dist.all_reduce(x["i"], op=dist.ReduceOp.BAND))):
        try:
            call()
            out[f"refused/{name}"] = None
        except NotImplementedError as exc:
            out[f"refused/{name}"] = str(exc)
    return out


def ddp(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model().to(DEV))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs, ys = batch()
    rows = xs.shape[1] // world
    losses, sent, got = [], [], []
    for step in range(STEPS):
        x, y = xs[step, rank * rows:(rank + 1) * rows], ys[step, rank * rows:(rank + 1) * rows]
        rgpu.stats(reset=True)  # the baseline for this step's bytes
        opt.zero_grad()
        if step == STEPS - 1:  # two micro-batches; gradients reduced once, after the second
            half = rows // 2
            with net.no_sync():
                torch.nn.functional.mse_loss(net(x[:half].to(DEV)), y[:half].to(DEV)).backward()
            loss = torch.nn.functional.mse_loss(net(x[half:].to(DEV)), y[half:].to(DEV))
        else:
            loss = torch.nn.functional.mse_loss(net(x.to(DEV)), y.to(DEV))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        counts = rgpu.stats()
        sent.append(counts["bytes_out"])
        got.append(counts["bytes_in"])
    grads = sum(p.numel() * p.element_size() for p in net.parameters())
    return {"params": [p.detach().cpu() for p in net.module.parameters()], "losses": losses,
            "bytes_out": sent, "bytes_in": got, "grad_bytes": grads}


def kill(rank: int, world: int, out_path: Path) -> dict:
    t = torch.ones(4, device=DEV)
    dist.all_reduce(t)
    t.sum().item()
    Path(f"{out_path}.ready").write_text("ready")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            dist.all_reduce(t)
            t.sum().item()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "at": time.time()}
        time.sleep(0.05)
    return {"error": None, "at": time.time()}


def stall(rank: int, world: int) -> dict:
    dist.barrier()  # both ranks here: the new group's join waits on nobody for long
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=STALL_TIMEOUT_S))
    if rank != 0:
        time.sleep(STALL_TIMEOUT_S + 5)  # alive, its server alive, never taking part
        return {}
    t, t0 = torch.ones(2, device=DEV), time.monotonic()
    try:
        dist.all_reduce(t, group=group)
        t.sum().item()
        return {"error": None, "after": time.monotonic() - t0}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "after": time.monotonic() - t0}


def main() -> None:
    scenarios, out_path = sys.argv[1].split(","), Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(os.environ.get("DIST_BACKEND", "rgpu"))
    results: dict = {}
    for scenario in scenarios:  # each one's results saved before the next (kill never returns a group intact)
        if scenario == "kill":
            results["kill"] = kill(rank, world, out_path)
        else:
            results[scenario] = {"collectives": collectives, "ddp": ddp, "stall": stall}[scenario](rank, world)
        torch.save(results, out_path)
    if "kill" not in scenarios:
        dist.destroy_process_group()
    os._exit(0)  # after a kill the session is broken: no goodbye to a dead group


if __name__ == "__main__":
    main()
