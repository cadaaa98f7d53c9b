"""``rgpu bench ops``: the client's cost of one streamed op, and a chain of small adds ending in ``.cpu()``.

    rgpu bench ops --json        (harness)    python -m rgpu.bench.ops --json   (standalone)

Baseline: the same ops in local eager on the server's kind of device in this
process (CUDA on a GPU host: the enqueue cost of a tiny kernel; else the CPU).
Each figure is the median of interleaved runs; ``spread`` is [min, max].
"""
from __future__ import annotations

import statistics
import time

from rgpu.bench import harness

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

    rgpu.register()  # the rgpu command loaded rgpu as a parent, which registers nothing
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

    def chain(dev, whole: bool):
        """One run of the chain on ``dev``: the client's time per op to enqueue it (us), or with ``whole``
        the chain through ``.cpu()`` (ms)."""
        def run():
            y = x[dev]
            torch.rgpu.synchronize() if dev == "rgpu" else sync()
            t0 = time.perf_counter()
            for _ in range(CHAIN):
                y = y + 1.0
            enqueued = time.perf_counter() - t0
            y.cpu()
            return (time.perf_counter() - t0) * 1e3 if whole else enqueued / CHAIN * 1e6
        return run

    per_op = _median_runs({dev: chain(dev, whole=False) for dev in x}, repeats)
    whole = _median_runs({dev: chain(dev, whole=True) for dev in x}, repeats)
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
        _row("round trips for that chain", "count", trips["round_trips"], "expected", 1, transport),
        _row("messages for that chain", "count", trips["messages"], "ops in the chain", CHAIN, transport),
    ]


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
