"""The server's cost of a training step's small upload (``Msg.UPLOAD``, a 128 KiB batch) on this host.

In-process ops executor on the GPU (no transport): each upload into a fresh id (the last step's
freed by the message's events, as the client sends them), on the Python path (its ring; timed
whole and in parts: the table's fresh tensor, the ring's copy into pinned memory, the queued copy
to the GPU, its event) and on the C++ path (``FastOps.upload``: CUDA's caching host allocator),
back to back ("warm") and right after a GPU wait of ~2 ms as at a step's start after
``loss.item()`` ("after a wait"). One JSON object on stdout: medians in microseconds.

    python tools/diag/diag_server_upload.py [--n 200]        (rgpu installed; run outside the tree)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _time_parts(ex, parts: dict, staging, np, torch) -> None:
    """Python's path timed in parts: the table's fresh tensor, the ring's copy, the queued copy, its event."""
    def timed(name, fn):
        def run(*a, **k):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                parts.setdefault(name, []).append(time.perf_counter_ns() - t)
        return run

    ex.table.tensor = timed("table.tensor", ex.table.tensor)
    staging.np.copyto = timed("ring copy into pinned", np.copyto)   # only the ring copies here

    def send(dst, host, done):
        t = time.perf_counter_ns()
        dst.copy_(host, non_blocking=True)
        t1 = time.perf_counter_ns()
        done.record(torch.cuda.current_stream(dst.device))
        parts.setdefault("copy_ to the GPU", []).append(t1 - t)
        parts.setdefault("event record", []).append(time.perf_counter_ns() - t1)
    plain_ring = ex.uploads._ring

    def ring(device):
        r = plain_ring(device)
        if r is not None:
            r.send = send
        return r
    ex.uploads._ring = ring


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    import numpy as np
    import torch

    from rgpu import config
    from rgpu.protocol.ops import Event, Msg
    from rgpu.server.ops import staging
    from rgpu.server.route import Session
    from rgpu.server.ops.executor import Executor

    batch = np.random.default_rng(0).integers(0, 97, (64, 256)).astype(np.int64)
    buf = memoryview(batch).cast("B")
    from rgpu.server.ops.codec import CODE_BY_DTYPE
    code = CODE_BY_DTYPE[torch.int64]
    big = torch.empty(1 << 24, device="cuda")
    results = {}
    for server_c in (False, True):   # Python's ring (timed in parts), then C++ and CUDA's host allocator
        ex = Executor(Session(id="u", route="ops", settings=config.settings(environ={}, device="cuda",
                                                                            server_c=server_c)))
        parts: dict[str, list] = {}
        if not server_c:
            _time_parts(ex, parts, staging, np, torch)
        path = "cpp" if server_c else "python"
        sid = 1000
        with ex.serving():
            for label, wait in (("warm", False), ("after a wait", True), ("warm", False), ("after a wait", True)):
                parts.clear()
                whole = []
                for i in range(args.n):
                    if wait:
                        for _ in range(20):
                            big.mul_(1.0001)
                        torch.cuda.synchronize()
                    events = [int(Event.FREE), sid - 2, int(Event.FREE), sid - 1] if i else []
                    for k in range(2):
                        desc = [sid + k, buf.nbytes, code, [64, 256], [256, 1], 0, 0]
                        t = time.perf_counter_ns()
                        ex.handle([int(Msg.UPLOAD), events if k == 0 else [], desc], [buf], False)
                        whole.append(time.perf_counter_ns() - t)
                    sid += 2
                torch.cuda.synchronize()
                results[f"{path}, {label}"] = {
                    "upload_us": statistics.median(whole[10:]) / 1e3,
                    "first_of_pair_us": statistics.median(whole[10::2]) / 1e3,
                    "second_of_pair_us": statistics.median(whole[11::2]) / 1e3,
                    **{k + "_us": statistics.median(v[5:]) / 1e3 for k, v in parts.items()}}
        results[f"{path}: C++ op path loaded"] = ex.fast is not None
        results[f"{path} pieces"] = ex.handle([int(Msg.UPLOAD_INFO)], [], True)[0]["pieces"]
        ex.close()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
