"""Where the eager step's client time goes over tcp: ``rgpu bench train`` with the client's tcp writes counted.

    python tools/diag/diag_tcp_step.py [--batch-s S] [--sndbuf BYTES] [--switch S] -- <rgpu bench train flags>

Adds rows to the bench's: writes by the calling threads and by the I/O thread, the time in
them, how many found the socket full (and the time waiting for room), over the whole run.
``--batch-s`` changes how long posts gather (``TcpTransport.capabilities.batch_window_s``), ``--sndbuf`` sets
the client socket's send buffer, ``--switch`` Python's GIL switch interval. A diagnosis, not a target.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from collections import Counter

from rgpu.bench import train
from rgpu.transport import tcp


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-s", type=float)
    parser.add_argument("--sndbuf", type=int)
    parser.add_argument("--switch", type=float)
    ours, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if ours.batch_s is not None:
        tcp.TcpTransport.capabilities = dataclasses.replace(tcp.TcpTransport.capabilities,
                                                            batch_window_s=ours.batch_s or None)
    if ours.switch:
        sys.setswitchinterval(ours.switch)
    counts, spent = Counter(), Counter()
    send, wait_io, tune = tcp.TcpTransport.send, tcp.TcpTransport._wait_io, tcp.tune

    def counted_send(self, parts):
        who = "io" if threading.current_thread().name == "rgpu-io" else "caller"
        t0 = time.perf_counter()
        try:
            return send(self, parts)
        finally:
            counts[who] += 1
            counts[who + "_parts"] += len(parts)
            spent[who] += time.perf_counter() - t0

    def counted_wait(self, read):
        t0 = time.perf_counter()
        try:
            return wait_io(self, read)
        finally:
            counts["full"] += 1
            spent["full"] += time.perf_counter() - t0

    def tuned(sock):
        tune(sock)
        if ours.sndbuf:
            import socket
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ours.sndbuf)

    tcp.TcpTransport.send, tcp.TcpTransport._wait_io, tcp.tune = counted_send, counted_wait, tuned
    rows = train.rows

    def with_counts(args=None, profile=None):
        out = rows(args, profile)
        for key in ("caller", "io", "full"):
            out.append({"bench": "diag_tcp", "transport": "tcp", "metric": f"{key}: count, seconds, parts",
                        "unit": "", "value": counts[key], "baseline": None, "ratio": None,
                        "spread": [spent[key], counts[key + "_parts"]]})
        return out

    train.rows = with_counts
    return train.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
