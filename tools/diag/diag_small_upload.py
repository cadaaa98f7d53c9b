"""The client's cost of a small upload (one 128 KiB batch, ``x.to("rgpu")``), as at each training step's start.

A traced compiled step on the GPU host showed ~0.25 ms of client time per 128 KiB upload (the
developer machine: ~0.03 ms). Per transport: the median per upload with the server idle, the part
in the transport's copy into its memory, and a cProfile of the Python path. JSON lines on stdout.

    python tools/diag/diag_small_upload.py        (rgpu installed; starts a local server per transport)
"""
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch


def measure(transport: str) -> dict:
    os.environ["RGPU_TRANSPORT"] = transport
    import rgpu
    from rgpu.transport import fastcopy

    x = torch.randint(0, 97, (64, 256))
    x.to("rgpu").cpu()
    plain, copied = fastcopy.copy, []

    def timed(dst, src):
        t = time.perf_counter_ns()
        plain(dst, src)
        copied.append(time.perf_counter_ns() - t)
    fastcopy.copy = timed
    idle, busy = [], []
    for i in range(300):
        if i % 3 == 0:
            torch.ones(8, device="rgpu").sum().item()   # the server idle: as after loss.item()
            time.sleep(0.002)
        t = time.perf_counter_ns()
        y = x.to("rgpu")
        (idle if i % 3 == 0 else busy).append((time.perf_counter_ns() - t) / 1e3)
    y.cpu()
    fastcopy.copy = plain
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        y = x.to("rgpu")
    y.cpu()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    return {"transport": rgpu.stats().get("transport") if hasattr(rgpu, "stats") else transport,
            "upload_us_after_idle": statistics.median(idle), "upload_us_back_to_back": statistics.median(busy),
            "copy_us": statistics.median(copied) / 1e3 if copied else None, "profile": text.getvalue()}


if __name__ == "__main__":
    import sys
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else "shm")))
