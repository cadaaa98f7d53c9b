"""Where a 1 GiB upload's time goes on the GPU host: the client's writes vs the server's copies, per variant.

    python3 tools/diag/diag_upload.py > upload.json      (RGPU_TRANSPORT=shm; the server is a local one)

Per variant (piece size, parallel copy on/off, pageable or pinned source): GB/s to synchronize, the time until the client's
last piece was written, the server's UPLOAD_INFO (which path the pieces took), the client heap's segments.
"""
import json
import sys
import time

import torch

import rgpu  # noqa: F401
from rgpu.device_backend import session, transfers
from rgpu.protocol.ops import Msg
from rgpu.transport import fastcopy

N = 1 << 30
s = session.get()
src = torch.ones(N // 4, dtype=torch.float32)
dst = torch.empty(N // 4, dtype=torch.float32, device="rgpu")
out = {"transport": s.conn.transport_name, "fastcopy": fastcopy.backend(), "runs": []}
pinned = torch.ones(N // 4, dtype=torch.float32).pin_memory()
variants = [(8 << 20, True, src), (32 << 20, True, src), (8 << 20, False, src),
            (8 << 20, True, pinned), (64 << 20, True, pinned), (256 << 20, True, pinned)]
for piece, parallel, source in variants:
        transfers.UPLOAD_PIECE_BYTES = piece
        fastcopy._enabled = parallel and fastcopy._kernel not in (None, False)
        times = []
        for _ in range(4):
            torch.rgpu.synchronize()
            t0 = time.perf_counter()
            dst.copy_(source)
            t1 = time.perf_counter()
            torch.rgpu.synchronize()
            t2 = time.perf_counter()
            times.append({"written_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3, "GBps": N / (t2 - t0) / 1e9})
        heap = getattr(getattr(s.conn.transport, "writer", None), "heap", None)   # shm's sender heap
        out["runs"].append({"piece": piece, "parallel_copy": fastcopy._enabled, "pinned": source is pinned,
                            "times": times, "shared_bytes": getattr(s.conn.transport, "shared_bytes", None),
                            "server": s.request([Msg.UPLOAD_INFO]),
                            "heap_segments": sorted(g.size for g in heap.segments.values()) if heap else None})
        print(json.dumps(out["runs"][-1]), file=sys.stderr)
t0 = time.perf_counter()
back = dst.cpu()
out["download_GBps"] = N / (time.perf_counter() - t0) / 1e9
out["download_ok"] = bool(back[:1000].eq(1).all())
print(json.dumps(out, indent=1))
