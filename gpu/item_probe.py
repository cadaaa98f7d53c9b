"""The device route's small reads on the GPU host: ``.item()`` and ``.cpu()`` of 4 floats, microseconds each.

    python gpu/item_probe.py [ROUNDS]     -> one JSON line: {"item_us": [...], "cpu_us": [...], "fast_path": {...}}

Each round is the median of 500 calls after 100 warm-up ones, the GPU idle before each (nothing queued), so a
figure is the read's round trip: the client's path to the server and back plus the server's copy. Run in two
trees on one host (gpu/check_ab.sh) it shows what a change to that path moved.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import rgpu  # noqa: F401  (registers the device)


def per_call_us(fn, n: int = 500) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    x = torch.arange(4.0).to("rgpu") + 1
    one = x[1]
    for _ in range(100):
        one.item(), x.cpu()
    got = {"item_us": [], "cpu_us": []}
    for _ in range(rounds):
        got["item_us"].append(per_call_us(one.item))
        got["cpu_us"].append(per_call_us(x.cpu))
    assert one.item() == 2.0 and x.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]   # the values, as the CPU computes them
    from rgpu.device_backend import session
    got["fast_path"] = session.current().C.fast_path_stats()
    got["transport"] = rgpu.stats()["transport"]
    print(json.dumps(got))


if __name__ == "__main__":
    main()
