"""The native copies ``rgpu bench upload`` compares with, in a process that never imports rgpu.

Why a process of its own: with PrivateUse1 registered (``import rgpu``), torch's
current accelerator is rgpu, and ``pin_memory()`` there did not give CUDA pinned
memory (the baseline ran at pageable speed: docs/perf/fast_path-history.md, "Uploads and downloads").

    python bench/h2d_baseline.py NBYTES      # then a copy's name on stdin -> {"GBps": x} on stdout, one per line

Copies: ``pinned`` (host-to-device from pinned memory), ``pageable`` (host-to-device from
ordinary memory), ``cpu`` (``.cpu()`` of a device tensor: a new host tensor, device-to-host).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    sys.path[:] = [d for d in sys.path if Path(d or ".").resolve() != HERE]  # bench/ holds cuda.py, ops.py...
    import torch

    n = int(sys.argv[1])
    pinned = torch.ones(n // 4, dtype=torch.float32).pin_memory()
    pageable = torch.ones(n // 4, dtype=torch.float32)
    dst = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    copies = {"pinned": lambda: dst.copy_(pinned, non_blocking=True), "pageable": lambda: dst.copy_(pageable),
              "cpu": lambda: dst.cpu()}
    print(json.dumps({"pinned": pinned.is_pinned(), "rgpu_imported": "rgpu" in sys.modules}), flush=True)
    for line in sys.stdin:
        copy = copies.get(line.strip())
        if copy is None:
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        print(json.dumps({"GBps": n / (time.perf_counter() - t0) / 1e9}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
