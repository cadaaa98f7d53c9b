"""The 64 B round trip's floor on this host without rgpu: two Python processes on different cores.

    python tools/diag/probe_rtt_floor.py [--json]      (from /tmp or anywhere; needs only the standard library)

- ``shm spin``: a counter in shared memory each side polls (what shm's ring is at heart);
- ``tcp poll``: loopback TCP, each side polling its socket with non-blocking reads (rgpu's tcp on a host
  of 8+ cores reads this way);
- ``tcp sleep``: loopback TCP, blocking reads (a wake-up each way: rgpu's tcp where it does not poll).

What it says: with P the two ends' per-message work, rgpu's shm round trip is about P + shm spin and
its tcp one about P + tcp poll (or tcp sleep), so it bounds the ratio the shm row can reach here.
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import sys
import time

N, RUNS = 20000, 5
WORD = struct.Struct("<Q")


_CPUS = sorted(os.sched_getaffinity(0))     # read before any pinning below


def cores() -> tuple[int, int]:
    return _CPUS[0], _CPUS[len(_CPUS) // 2]


def _median_us(times: list[float]) -> float:
    times.sort()
    return times[len(times) // 2] * 1e6


def shm_spin() -> float:
    mem = mmap.mmap(-1, 4096)
    a, b = cores()
    pid = os.fork()
    if pid == 0:                       # the echo side: wait for i at 0, answer i at 64
        os.sched_setaffinity(0, {b})
        i = 0
        while True:
            i += 1
            while WORD.unpack_from(mem, 0)[0] != i:
                pass
            if i > N * RUNS + 1000:
                os._exit(0)
            WORD.pack_into(mem, 64, i)
    os.sched_setaffinity(0, {a})
    runs, i = [], 0
    for r in range(RUNS + 1):
        times = []
        for _ in range(N if r else 1000):
            i += 1
            t0 = time.perf_counter()
            WORD.pack_into(mem, 0, i)
            while WORD.unpack_from(mem, 64)[0] != i:
                pass
            times.append(time.perf_counter() - t0)
        if r:
            runs.append(_median_us(times))
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return sorted(runs)[len(runs) // 2]


def _recv_exactly(sock: socket.socket, buf: bytearray, poll: bool) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        try:
            n = sock.recv_into(view[got:], len(buf) - got, socket.MSG_DONTWAIT if poll else 0)
        except BlockingIOError:
            continue
        if n == 0:
            raise ConnectionError("closed")
        got += n


def tcp(poll: bool) -> float:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    a, b = cores()
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {b})
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(64)
        try:
            while True:
                _recv_exactly(conn, buf, poll)
                conn.sendall(buf)
        except (ConnectionError, OSError):
            os._exit(0)
    os.sched_setaffinity(0, {a})
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, back, runs = bytes(64), bytearray(64), []
    for r in range(RUNS + 1):
        times = []
        for _ in range(N if r else 1000):
            t0 = time.perf_counter()
            sock.sendall(out)
            _recv_exactly(sock, back, poll)
            times.append(time.perf_counter() - t0)
        if r:
            runs.append(_median_us(times))
    sock.close()
    os.waitpid(pid, 0)
    listener.close()
    return sorted(runs)[len(runs) // 2]


def main() -> int:
    got = {"shm spin": shm_spin(), "tcp poll": tcp(True), "tcp sleep": tcp(False), "cores": cores()}
    got["shm spin / tcp poll"] = got["shm spin"] / got["tcp poll"]
    got["shm spin / tcp sleep"] = got["shm spin"] / got["tcp sleep"]
    print(json.dumps(got) if "--json" in sys.argv else "\n".join(f"{k}: {v}" for k, v in got.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
