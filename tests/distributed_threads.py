"""test_distributed's one-client form: ``python tests/distributed_threads.py OUT`` with RGPU_SERVER=a,b.

One process, one thread per device (rgpu:0 on server a, rgpu:1 on server b), each its own group rank
(``ProcessGroupRgpu`` on a shared HashStore): an all_reduce, then DDP for two steps. Saves the results.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading

import torch

import torch.distributed as dist
from distributed_data import batch, inputs, model
from rgpu.distributed import ProcessGroupRgpu  # the device registered by this import alone
from torch.nn.parallel import DistributedDataParallel

WORLD, STEPS = 2, 2


def rank(r: int, store, nets: list, out: dict) -> None:
    try:
        torch.rgpu.set_device(r)  # this thread's device: its group's collectives go to that device's server
        dev = f"rgpu:{r}"
        pg = ProcessGroupRgpu(store, r, WORLD, datetime.timedelta(seconds=30))
        t = inputs(r)["f"].to(dev)
        pg.allreduce([t]).wait()
        out[f"all_reduce/{r}"] = t.cpu()
        net = DistributedDataParallel(nets[r].to(dev), process_group=pg)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        xs, ys = batch()
        rows = xs.shape[1] // WORLD
        for step in range(STEPS):
            x, y = xs[step, r * rows:(r + 1) * rows], ys[step, r * rows:(r + 1) * rows]
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x.to(dev)), y.to(dev)).backward()
            opt.step()
        out[f"params/{r}"] = [p.detach().cpu() for p in net.module.parameters()]
    except BaseException as exc:  # said in the results: the test names it
        out[f"error/{r}"] = f"{type(exc).__name__}: {exc}"


def main() -> None:
    store, out = dist.HashStore(), {}
    nets = [model() for _ in range(WORLD)]  # built here: torch.manual_seed is the process's
    threads = [threading.Thread(target=rank, args=(r, store, nets, out)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    torch.save(out, sys.argv[1])
    os._exit(0)


if __name__ == "__main__":
    main()
