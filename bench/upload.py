"""``rgpu bench upload``: bytes from this process into device memory, beside the server host's own copy.

    rgpu bench upload --json [--sizes 1G] [--repeats 5] [--quick]     python -m rgpu.bench.upload --json

Value: GB/s of ``dst.copy_(src)`` from a CPU tensor into a preallocated rgpu
tensor, timed to ``torch.rgpu.synchronize()`` (big uploads go in 8 MiB pieces,
staged through pinned memory on a GPU server). Baseline, measured in the same
run and interleaved: on a GPU host (client and server share it), a pinned
host-to-device copy of the same size in a helper process that never imports rgpu
(``h2d_baseline.py``; with rgpu registered, pinning gives no CUDA pinned memory); with a CPU server, a
memcpy of the same size into a preallocated buffer (``numpy.copyto``).
Default size 1 GiB (``--quick``: 64 MiB).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rgpu.bench import harness


def rows(args=None) -> list[dict]:
    import numpy as np
    import torch

    from rgpu.device_backend import session
    from rgpu.ops_protocol import Msg

    quick = getattr(args, "quick", False)
    sizes = harness.parse_sizes(getattr(args, "sizes", None), [64 << 20] if quick else [1 << 30])
    repeats = 3 if quick else harness.repeats_of(args)
    s = session.get()
    on_gpu = torch.cuda.is_available() and s.kind == "cuda"
    out = []
    for n in sizes:
        src = torch.ones(n // 4, dtype=torch.float32)
        dst = torch.empty(n // 4, dtype=torch.float32, device="rgpu")

        def upload():
            torch.rgpu.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.rgpu.synchronize()
            return n / (time.perf_counter() - t0) / 1e9

        helper = None
        if on_gpu:
            # in a process without rgpu: here torch's accelerator is rgpu, and pinning gives no CUDA pinned memory
            helper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("h2d_baseline.py")), str(n)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            started = json.loads(helper.stdout.readline() or "{}")
            name = f"pinned host-to-device copy on the GPU host (a process without rgpu; pinned: {started.get('pinned')})"

            def baseline():
                helper.stdin.write("copy\n")
                helper.stdin.flush()
                return json.loads(helper.stdout.readline())["GBps"]
        else:
            a, b = src.numpy(), np.empty(n // 4, dtype=np.float32)
            name = "memcpy of the same size (numpy.copyto, this process)"

            def baseline():
                t0 = time.perf_counter()
                np.copyto(b, a)
                return n / (time.perf_counter() - t0) / 1e9

        try:
            upload(), baseline()  # warm: pieces' staging slots, pages, the copy path
            result = harness.compare(upload, baseline, repeats)
        finally:
            if helper is not None:
                helper.stdin.close()
                helper.wait(30)
        how = s.request([Msg.UPLOAD_INFO])  # which path the server's pieces took
        out.append(harness.row("upload", s.conn.transport_name, "bandwidth", n, result, name,
                               server=s.kind, server_pieces=how))
        del dst
    return out


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__, flags={"--sizes": {"help": "comma list, e.g. 256M,1G"}})


if __name__ == "__main__":
    raise SystemExit(main())
