"""Stock CUDA PyTorch's own kernels in a loop, timed: run natively and through `rgpu intercept run`.

    python -m rgpu.bench.cuda_torch_loop [--ops 1000] [--repeats 5]     prints one JSON line

A chain of small elementwise kernels ending in one ``.cpu()`` (the rung where torch's own
kernels run and only data waits), and what the process sent: when rgpu's libraries are the
ones loaded, the interceptor's connection counts messages, round trips and bytes.
"""
import argparse
import json
import statistics
import time

import torch


def interceptor_stats():
    """The interceptor's connection counters in this process, or None when rgpu is not loaded."""
    try:
        from rgpu.cuda_intercept import client
        conn = client._client.conn if client._client is not None else None
    except Exception:       # rgpu not installed here, or not the libcuda.so.1 in this process
        return None
    if conn is None:
        return None
    from rgpu.cuda_intercept.calls_code import IMAGES   # module images: loaded, uploaded, trimmed
    return dict(conn.stats, **{f"images_{k}": v for k, v in IMAGES.items()})


def chain(x: torch.Tensor, ops: int) -> torch.Tensor:
    for _ in range(ops):
        x = x + 1.0
    return x.cpu()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    x = torch.zeros(1024, device="cuda")
    chain(x, 10)                                   # first use: the fatbins of these kernels load
    first_s = time.perf_counter() - t0
    after_first = interceptor_stats()
    times, rts = [], []
    for _ in range(args.repeats):
        before = interceptor_stats()
        t = time.perf_counter()
        out = chain(x, args.ops)
        times.append((time.perf_counter() - t) * 1e3)
        after = interceptor_stats()
        if before and after:
            rts.append(after["round_trips"] - before["round_trips"])
    assert float(out[0]) == float(args.ops), f"chain gave {float(out[0])}, expected {args.ops}"
    print(json.dumps({"loop_ms": statistics.median(times), "loop_ms_all": times, "first_use_s": first_s,
                      "round_trips_per_loop": statistics.median(rts) if rts else None,
                      "bytes_out_at_first_use": after_first["bytes_out"] if after_first else None,
                      "images_at_first_use": {k[7:]: v for k, v in after_first.items() if k.startswith("images_")}
                      if after_first else None,
                      "rgpu": after_first is not None}))


if __name__ == "__main__":
    main()
