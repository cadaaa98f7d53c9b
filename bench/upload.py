"""``rgpu bench upload``: bytes between this process and device memory, beside the server host's own copies.

    rgpu bench upload --json [--sizes 1G] [--repeats 5] [--quick]     python -m rgpu.bench.upload --json

Three rows per size, each timed to ``torch.rgpu.synchronize()`` and interleaved with
its baseline from the same run:

- upload from pinned memory (``pin_memory()``): over shm it is sent by naming its
  shared block, no copy, and the server's GPU reads it by DMA. Baseline: a pinned
  host-to-device copy.
- upload from ordinary memory: copied once into the transport (in pieces, the
  server's copies to the GPU overlapping). Baseline: a pageable host-to-device copy.
- download into a new tensor (``.cpu()``). Baseline: ``.cpu()`` of a CUDA tensor.

Each upload row names its pieces' size (``piece_bytes``: tcp 16 MiB, held rather than copied by
the replay log); ``server_pieces`` says how the server took them (staged, DMA'd, on the CPU) and
how many downloads it answered from its kept pinned buffer (``download kept``).

On a GPU host the baselines run in a helper process that never imports rgpu
(``h2d_baseline.py``; with rgpu registered, pinning gives no CUDA pinned memory);
with a CPU server each baseline is a memcpy of the same size (``numpy.copyto``).
Default size 1 GiB (``--quick``: 64 MiB).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rgpu.bench import harness

FIGURES = (  # (metric, the native copy in h2d_baseline.py, its name)
    ("upload from pinned memory", "pinned", "pinned host-to-device copy"),
    ("upload from ordinary memory", "pageable", "pageable host-to-device copy"),
    ("download into a new tensor (.cpu())", "cpu", ".cpu() of a CUDA tensor"),
)


def _native(n: int):
    """(copy name -> GB/s of one native copy, whether the helper's memory was pinned, close)."""
    helper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("h2d_baseline.py")), str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started = json.loads(helper.stdout.readline() or "{}")

    def copy(name: str) -> float:
        helper.stdin.write(name + "\n")
        helper.stdin.flush()
        return json.loads(helper.stdout.readline())["GBps"]

    def close():
        helper.stdin.close()
        helper.wait(30)
    return copy, started.get("pinned"), close


def rows(args=None) -> list[dict]:
    import numpy as np
    import torch

    import rgpu
    from rgpu.device_backend import session
    from rgpu.protocol.ops import Msg

    rgpu.register()  # the rgpu command loaded rgpu as a parent, which registers nothing
    quick = getattr(args, "quick", False)
    sizes = harness.parse_sizes(getattr(args, "sizes", None), [64 << 20] if quick else [1 << 30])
    repeats = 3 if quick else harness.repeats_of(args)
    s = session.get()
    on_gpu = torch.cuda.is_available() and s.kind == "cuda"
    out = []
    for n in sizes:
        sources = {"pinned": torch.ones(n // 4, dtype=torch.float32).pin_memory(),
                   "pageable": torch.ones(n // 4, dtype=torch.float32)}
        dst = torch.empty(n // 4, dtype=torch.float32, device="rgpu")

        def timed(fn):
            def run():
                torch.rgpu.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.rgpu.synchronize()
                return n / (time.perf_counter() - t0) / 1e9
            return run

        if on_gpu:
            native, pinned, close = _native(n)
            where = f"on the GPU host (a process without rgpu; pinned: {pinned})"
        else:
            a, b = sources["pageable"].numpy(), np.empty(n // 4, dtype=np.float32)

            def native(name):
                t0 = time.perf_counter()
                np.copyto(b, a)
                return n / (time.perf_counter() - t0) / 1e9
            close, where = (lambda: None), "here: memcpy of the same size (numpy.copyto), CPU server"
        try:
            for metric, copy, base_name in FIGURES:
                mine = timed(dst.cpu if copy == "cpu" else (lambda src=sources.get(copy): dst.copy_(src)))
                theirs = lambda copy=copy: native(copy)  # noqa: E731
                mine(), theirs()  # warm: stages, pages, the copy path
                result = harness.compare(mine, theirs, repeats)
                name = f"{base_name} {where}" if on_gpu else where
                out.append(harness.row("upload", s.conn.transport_name, metric, n, result, name, unit="GB/s",
                                       server=s.kind, piece_bytes=s.transfers.piece_bytes(s.transfers.shared(
                                           sources.get(copy, dst))) if copy != "cpu" else None,
                                       shared_bytes=getattr(s.conn.transport, "shared_bytes", 0)))
        finally:
            close()
        how = s.request([Msg.UPLOAD_INFO])  # which path the server's pieces took
        for r in out[-len(FIGURES):]:
            r["server_pieces"] = how
        dst = None  # the device copy goes before the next size's is made (a name, not del: the lambdas above read it)
    return out


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__, flags={"--sizes": {"help": "comma list, e.g. 256M,1G"}})


if __name__ == "__main__":
    raise SystemExit(main())
