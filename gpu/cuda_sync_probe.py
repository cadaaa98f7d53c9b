"""Where a synchronising call's time goes on the CUDA route: stock torch's small reads on an idle GPU, and a
captured graph's replay split into its launch and its read, natively or through rgpu.

    python3 gpu/cuda_sync_probe.py                                  (native)
    rgpu intercept run -- python3 gpu/cuda_sync_probe.py            (through rgpu; gpu/check_cuda_sync.sh runs both)

Prints one JSON line of medians in microseconds (each of ``N`` calls after a warm-up): ``item_idle`` (``.item()``
of a GPU scalar with nothing queued: one round trip through the route's client and server), ``sync_idle``
(``torch.cuda.synchronize()`` with nothing queued), ``replay_launch`` and ``replay_item`` (a captured chain of
matmuls: ``g.replay()``'s return, then its ``.item()``), ``replay_step`` (both), and ``gpu_us`` (the chain's own GPU
time, from CUDA events); the replayed output equals the eager one (``equal``).
"""
from __future__ import annotations

import json
import statistics
import time

N = 300


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main() -> None:
    import torch

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    scalar = torch.ones(4, device=dev).sum()
    for _ in range(50):
        scalar.item()
        torch.cuda.synchronize()
    got = {}
    samples = []
    for _ in range(N):
        t0 = time.perf_counter()
        scalar.item()
        samples.append(time.perf_counter() - t0)
    got["item_idle"] = median_us(samples)
    samples = []
    for _ in range(N):
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    got["sync_idle"] = median_us(samples)

    w = torch.randn(512, 512, device=dev) / 23
    x = torch.randn(512, 512, device=dev)

    def chain(v):
        for _ in range(12):
            v = torch.tanh(v @ w)
        return v.sum()

    eager = chain(x).item()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            chain(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x)
    for _ in range(20):
        g.replay()
        out.item()
    launch, read, step = [], [], []
    for _ in range(N):
        t0 = time.perf_counter()
        g.replay()
        t1 = time.perf_counter()
        value = out.item()
        t2 = time.perf_counter()
        launch.append(t1 - t0), read.append(t2 - t1), step.append(t2 - t0)
    got.update(replay_launch=median_us(launch), replay_item=median_us(read), replay_step=median_us(step),
               equal=value == eager)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    got["gpu_us"] = statistics.median(times)
    print(json.dumps(got))


if __name__ == "__main__":
    main()
