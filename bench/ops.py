"""``rgpu bench ops``: the client's cost of one streamed op, and a chain of small adds ending in ``.cpu()``.

    rgpu bench ops --json        (harness)    python -m rgpu.bench.ops --json   (standalone)

Baseline: the same ops in local eager on the server's kind of device in this
process (CUDA on a GPU host: the enqueue cost of a tiny kernel; else the CPU).
Each figure is the median of interleaved runs; ``spread`` is [min, max].
"""
from __future__ import annotations

import statistics
import time

CHAIN = 1000  # adds per run
SIZE = 4      # elements per tensor


def _median_runs(fns: dict, repeats: int) -> dict:
    """Interleave the named functions ``repeats`` times; per name: (median, min, max) of their results."""
    got = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            got[name].append(fn())
    return {name: (statistics.median(v), min(v), max(v)) for name, v in got.items()}


def _row(metric, unit, value, baseline_name, baseline, transport, spread=None, size=SIZE * 4) -> dict:
    return {"bench": "ops", "transport": transport, "metric": metric, "unit": unit, "size": size,
            "value": value, "baseline_name": baseline_name, "baseline": baseline,
            "ratio": value / baseline if baseline else None, "spread": spread}


def rows(args=None) -> list[dict]:
    import torch

    import rgpu
    from rgpu.device_backend import session

    repeats = 3 if getattr(args, "quick", False) else getattr(args, "repeats", 5) or 5
    native = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    sync = torch.cuda.synchronize if native == "cuda" else (lambda: None)
    x = {"rgpu": torch.ones(SIZE, device="rgpu"), native: torch.ones(SIZE, device=native)}
    for dev in x:  # warm: ops defined, meta cache filled, kernels loaded
        y = x[dev]
        for _ in range(20):
            y = y + 1.0
        y.cpu()

    def enqueue(dev):
        def run():
            y = x[dev]
            torch.rgpu.synchronize() if dev == "rgpu" else sync()
            t0 = time.perf_counter()
            for _ in range(CHAIN):
                y = y + 1.0
            per_op = (time.perf_counter() - t0) / CHAIN * 1e6
            y.cpu()
            return per_op
        return run

    def chain(dev):
        def run():
            y = x[dev]
            torch.rgpu.synchronize() if dev == "rgpu" else sync()
            t0 = time.perf_counter()
            for _ in range(CHAIN):
                y = y + 1.0
            y.cpu()
            return (time.perf_counter() - t0) * 1e3
        return run

    per_op = _median_runs({"rgpu": enqueue("rgpu"), native: enqueue(native)}, repeats)
    whole = _median_runs({"rgpu": chain("rgpu"), native: chain(native)}, repeats)
    torch.rgpu.synchronize()
    rgpu.stats(reset=True)
    y = x["rgpu"]
    for _ in range(CHAIN):
        y = y + 1.0
    y.cpu()
    trips = rgpu.stats()
    transport = trips["transport"]
    base = f"{native} eager (this process)"
    server = session.current().kind
    return [
        _row("client cost per streamed op (add, 4 elements)", "us", per_op["rgpu"][0], base + " enqueue",
             per_op[native][0], transport, [per_op["rgpu"][1], per_op["rgpu"][2]]),
        _row(f"chain of {CHAIN} adds ending in .cpu() (server: {server})", "ms", whole["rgpu"][0], base,
             whole[native][0], transport, [whole["rgpu"][1], whole["rgpu"][2]]),
        _row(f"round trips for that chain", "count", trips["round_trips"], "expected", 1, transport),
        _row(f"messages for that chain", "count", trips["messages"], "ops in the chain", CHAIN, transport),
    ]


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    out = rows(args)
    print(json.dumps(out, indent=1) if args.json else "\n".join(
        f"{r['metric']:58s} {r['value']:10.2f} {r['unit']:5s} vs {r['baseline']:10.2f} ({r['baseline_name']})"
        for r in out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
