"""Python's cost of a lone 64 B call over shm, in one process: the client's call with its reply already
queued, and the server's read of the request. No waiting in either figure: what it measures is how fast
this machine runs the per-message Python (the GPU host's is about 1.75x the developer machine's).

    python tools/diag/diag_lone_call.py        (from the repository root; rgpu installed)
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))   # tools/diag/ -> the repository's tests/
import numpy as np  # noqa: E402

from rgpu import config  # noqa: E402
from rgpu.transport.connection import Connection  # noqa: E402
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view  # noqa: E402
from transport_pairs import pair  # noqa: E402

limits, pool = Limits(), BufferPool()
with pair("shm") as (c, s):
    conn = Connection(c, config.settings(environ={}))
    out, back = np.arange(64, dtype=np.uint8), [memoryview(bytearray(64))]
    seq, n = 0, 30000
    for _ in range(3):
        client = server = 0
        for _ in range(n):
            seq += 1
            s.send(s.frame_parts(MsgKind.REPLY, seq, seq, {"posts": 0}, [as_bytes_view(out)]))
            t = time.perf_counter_ns()
            conn.call({"op": "echo"}, [out], reply_into=back)
            client += time.perf_counter_ns() - t
            t = time.perf_counter_ns()
            s.recv_frame(limits, pool).release()
            server += time.perf_counter_ns() - t
        print(f"client call {client / n / 1e3:.2f} us, server recv {server / n / 1e3:.2f} us")
