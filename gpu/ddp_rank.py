"""One rank of gpu/ddp_check.py: DDP of the nanoGPT-class model through rgpu or natively; rank 0 writes JSON.

    python gpu/ddp_rank.py ROUTE KIND SIZE STEPS WARMUP OUT     (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

ROUTE rgpu: the rank's model on rgpu:RANK of RGPU_SERVER, init_process_group("rgpu"), DDP(device_ids=None);
native: cuda:RANK and NCCL (KIND cuda) or the CPU and gloo (KIND cpu). SIZE: nanogpt (6 layers, 384 wide,
block 256, 64 rows a rank) or small (the dry run's). Every rank trains on its rows of one seeded batch a step.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "nanogpt"))
from model import GPT, GPTConfig  # noqa: E402

SIZES = {"nanogpt": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, rows=64),
         "small": dict(n_layer=2, n_head=2, n_embd=64, block_size=32, rows=8)}
VOCAB = 97


def main() -> None:
    route, kind, size, steps, warmup, out = sys.argv[1:7]
    steps, warmup = int(steps), int(warmup)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    p = dict(SIZES[size])
    rows = p.pop("rows")
    if route == "rgpu":
        import rgpu  # noqa: F401  (the device, by the package's own name)
        import rgpu.distributed  # noqa: F401  (the backend)
        torch.rgpu.set_device(rank)  # each rank its own session and device of the one server
        dev, backend, ids = f"rgpu:{rank}", "rgpu", None
    elif kind == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # as rgpu's servers
        dev, backend, ids = f"cuda:{rank}", "nccl", [rank]
    else:
        dev, backend, ids = "cpu", "gloo", None
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, dropout=0.0, **p)).to(dev)
    net = DistributedDataParallel(model, device_ids=ids)
    opt = model.configure_optimizer(3e-4)
    g = torch.Generator().manual_seed(1234)
    times, losses = [], []
    for _ in range(warmup + steps):
        full = torch.randint(0, VOCAB, (rows * world, p["block_size"] + 1), generator=g)
        mine = full[rank * rows:(rank + 1) * rows]
        t0 = time.perf_counter()
        _, loss = net(mine[:, :-1].contiguous().to(dev), mine[:, 1:].contiguous().to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # the step's one wait
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"route": route, "world": world, "step_s": times[warmup:], "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
