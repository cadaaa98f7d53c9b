"""rgpu's tcp (and ucx) across a veth LAN between two network namespaces, beside a raw socket there.

    rgpu bench transport --netns [--rate 10gbit] --json          (harness)
    python -m rgpu.bench.transport_lan [--rate 10gbit] [--json] [--quick] [--repeats N]   (standalone; root)

The server side (``rgpu serve`` and a raw-socket sink) runs in namespace b, the
client in namespace a (``ip netns exec``), joined by a veth pair, optionally
rate limited with ``tc ... tbf``. Figures, interleaved and each the median of
``repeats`` runs: upload of 64 MiB (rgpu: ``checksum`` reading one byte; raw:
``sendall`` of the same buffer into a sink that ``recv_into``s one preallocated
buffer, then one byte back) and the round trip of 64 B. shm never applies here:
the namespaces share the host but not a network namespace, so the server's Unix
socket is out of reach and the proof fails (that is tested, tests/test_netns.py).
UCX is kept off shared memory (``UCX_TLS=^shm,cma``): the LAN stands for two hosts.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

from . import netns
from .transport_fast import interleave, label, row

SIZE = 64 << 20
RTT_CALLS = 300
TOKEN = "bench-lan"


# ---- the raw-socket baseline --------------------------------------------------------------

def sink(host: str) -> None:
    """Accept one connection; for each (8-byte length, payload): receive it all, answer one byte."""
    listener = socket.create_server((host, 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(np.empty(SIZE, np.uint8))
    head = bytearray(8)
    while True:
        if conn.recv_into(head, 8, socket.MSG_WAITALL) < 8:
            return
        n = struct.unpack("<Q", head)[0]
        got = 0
        while got < n:
            k = conn.recv_into(buf[got:n])
            if not k:
                return
            got += k
        conn.sendall(b"k")


class RawClient:
    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trip(self, n: int = RTT_CALLS) -> float:
        small = struct.pack("<Q", 64) + b"x" * 64
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.sock.sendall(small)
            self.sock.recv(1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6


def client(server: str, raw: str, transports: list[str], repeats: int, size: int) -> dict:
    """Runs in namespace a: every figure for every transport and the raw socket, interleaved."""
    from rgpu import config
    from rgpu.transport.client import connect

    from .transport_fast import round_trip, times_for, upload

    buf = np.ones(size, np.uint8)
    k = times_for(size)
    rawc = RawClient(raw)
    conns = {}
    for t in transports:
        conns[t] = connect("echo", settings=config.settings(environ={}, server=server, token=TOKEN, transport=t))
        assert conns[t].transport_name == t, f"asked for {t}, got {conns[t].transport_name}"
    figs = {"raw upload": lambda: _raw_upload(rawc, buf, k), "raw rtt": rawc.round_trip}
    for t, c in conns.items():
        figs[f"{t} upload"] = lambda c=c: upload(c, buf, k)
        figs[f"{t} rtt"] = lambda c=c: round_trip(c, RTT_CALLS)
    got = interleave(figs, repeats)
    for c in conns.values():
        c.close()
    return got


def _raw_upload(rawc: RawClient, buf: np.ndarray, n: int) -> float:
    head = struct.pack("<Q", buf.nbytes)
    t0 = time.perf_counter()
    for _ in range(n):
        _gather_all(rawc.sock, [memoryview(head), memoryview(buf).cast("B")])   # as rgpu's tcp writes
        rawc.sock.recv(1)
    return buf.nbytes * n / (time.perf_counter() - t0) / 1e9


def _gather_all(sock: socket.socket, parts: list) -> None:
    while parts:
        sent = sock.sendmsg(parts)
        while sent:
            if sent >= parts[0].nbytes:
                sent -= parts.pop(0).nbytes
            else:
                parts[0] = parts[0][sent:]
                sent = 0


# ---- the rows ------------------------------------------------------------------------------

def _start(lan, argv: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    proc = lan.popen("b", argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    return proc, proc.stdout.readline()


def rows(args=None) -> list[dict]:
    why = netns.unavailable()
    if why:
        raise RuntimeError(f"rgpu bench transport --netns: {why}")
    quick = getattr(args, "quick", False)
    repeats = 3 if quick else max(3, getattr(args, "repeats", 5) or 5)
    rate = getattr(args, "rate", None)
    wanted = [t for t in (getattr(args, "transport", None) or "tcp,ucx").split(",") if t in ("tcp", "ucx")]
    from rgpu.transport import negotiate
    transports = [t for t in wanted if negotiate.unavailable(t) is None] or ["tcp"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env.update(RGPU_TOKEN=TOKEN, RGPU_TOKEN_FILE="/nonexistent/rgpu-bench-lan-token")
    # Two namespaces are one host to UCX: left alone it would use shared memory across them
    # (and its wake-up socket, per namespace, would not reach). The LAN stands for two hosts.
    env.setdefault("UCX_TLS", "^shm,cma")
    procs = []
    with netns.lan(rate) as lan:
        try:
            server, line = _start(lan, [sys.executable, "-m", "rgpu", "serve", "--host", lan.addr_b, "--port", "0",
                                        "--preload", ""], env)
            procs.append(server)
            if "listening on" not in line:
                raise RuntimeError(f"rgpu serve in the namespace did not start: {line}")
            address = line.split("listening on ")[1].split(";")[0].strip()
            raw, port = _start(lan, [sys.executable, "-m", "rgpu.bench.transport_lan", "--sink", lan.addr_b], env)
            procs.append(raw)
            done = lan.run("a", [sys.executable, "-m", "rgpu.bench.transport_lan", "--client", address,
                                 "--raw", f"{lan.addr_b}:{port.strip()}", "--transports", ",".join(transports),
                                 "--repeats", str(repeats), "--size", str(SIZE)], env=env, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"the client in namespace a failed:\n{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            for p in procs:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    where = f"netns LAN{f' {rate}' if rate else ''}"
    out = []
    for t in transports:
        out.append(row(t, f"upload {label(SIZE)} over {where}", "GB/s", SIZE, got[f"{t} upload"],
                       "raw socket in the same namespaces, same run", got["raw upload"], rate=rate))
        out.append(row(t, f"round trip 64 B over {where}", "us", 64, got[f"{t} rtt"],
                       "raw socket in the same namespaces, same run", got["raw rtt"], rate=rate))
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rate", default=None, help="tbf rate on both veth ends, e.g. 10gbit")
    p.add_argument("--transport", default=None, help="tcp,ucx (default: both where available)")
    p.add_argument("--sink", help=argparse.SUPPRESS)         # the raw-socket server, in namespace b
    p.add_argument("--client", help=argparse.SUPPRESS)       # the measuring client, in namespace a
    p.add_argument("--raw", help=argparse.SUPPRESS)
    p.add_argument("--transports", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=SIZE, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sink:
        sink(args.sink)
        return 0
    if args.client:
        got = client(args.client, args.raw, args.transports.split(","), args.repeats, args.size)
        print(json.dumps(got))
        return 0
    out = rows(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        from .transport_fast import format_rows
        print(format_rows(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
