"""An idle ``.item()`` of a device tensor (the C++ fast path's read): the connection's lone call against the same
read through a request and its future (the lone call declined), interleaved, medians of each run's reads.

    RGPU_TRANSPORT=shm python tools/diag/diag_item_call.py [--runs 9] [--reads 2000]
    (RGPU_SERVER / RGPU_TOKEN_FILE for a running server, else a local one; pin the client apart from it:
    taskset -c 0 here, the server started under taskset -c 1)
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

import rgpu  # noqa: F401  (registers the device)
from rgpu.device_backend import session

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))   # tools/diag/ -> the repository's gpu/
from item_probe import per_call_us  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--reads", type=int, default=2000)
    args = p.parse_args()
    y = torch.arange(8.0).to("rgpu")[3]
    s = session.current()
    conn, lone = s.conn, s.conn._lone

    for _ in range(500):
        y.item()
    alone, requested = [], []
    try:
        for _ in range(args.runs):
            conn._lone = lone
            alone.append(per_call_us(y.item, args.reads))
            conn._lone = lambda *a: None       # declined: Connection.call's request and future
            requested.append(per_call_us(y.item, args.reads))
    finally:
        conn._lone = lone
    ratio = statistics.median([a / b for a, b in zip(alone, requested)])
    print(f"{conn.transport_name}: lone call {statistics.median(alone):.1f} us [{min(alone):.1f}-{max(alone):.1f}], "
          f"request {statistics.median(requested):.1f} us [{min(requested):.1f}-{max(requested):.1f}], ratio {ratio:.3f}; "
          f"C++ reads {s.C.fast_path_stats()['items']}")


if __name__ == "__main__":
    main()
