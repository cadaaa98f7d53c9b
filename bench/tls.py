"""What TLS costs on the tcp transport: each figure over TLS beside plain tcp, same run, interleaved.

    rgpu bench transport --tls --json     (harness: these rows beside the tcp rows)
    python -m rgpu.bench.tls [--json] [--quick] [--repeats N]     (standalone)

Two local servers on loopback, one plain and one ``--tls`` (self-signed
certificate, pinned), both on the echo route, clients forced to tcp. Figures:
the round trip of a request with no buffer, the cost of one small post
(64 B, batched by the I/O thread), upload (``checksum``: the bytes go one way)
and echo (both ways, counted twice) at 64 KiB, 1 MiB and 64 MiB. Each figure
is the median of ``repeats`` interleaved runs; ``spread`` is [min, max];
``ratio`` = TLS / plain.
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = (64 << 10, 1 << 20, 64 << 20)
POSTS = 2000


class _Server:
    def __init__(self, folder: str, *flags: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        env.update(RGPU_TOKEN="bench", RGPU_TOKEN_FILE=os.path.join(folder, "token"))
        self.proc = subprocess.Popen([sys.executable, "-m", "rgpu", "serve", "--port", "0", "--preload", "", *flags],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
        out = ""
        while "listening on" not in out or ("--tls" in flags and "RGPU_TLS_FINGERPRINT=" not in out):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"rgpu serve {' '.join(flags)} did not start: {out}")
            out += line
        self.address = re.search(r"listening on (\S+:\d+)", out).group(1)
        pin = re.search(r"RGPU_TLS_FINGERPRINT=(\S+)", out)
        self.fingerprint = pin.group(1) if pin else None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _round_trip(conn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        conn.call({"op": "sizes"})
    return (time.perf_counter() - t0) / n


def _post(conn, n: int = POSTS) -> float:
    small = b"x" * 64
    t0 = time.perf_counter()
    for _ in range(n):
        conn.post({"op": "sizes"}, [small])
    conn.call({"op": "sizes"})
    return (time.perf_counter() - t0) / n


def _upload(conn, buf: np.ndarray, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        conn.call({"op": "checksum", "stride": 1 << 30}, [buf])
    return buf.nbytes * n / (time.perf_counter() - t0)


def _echo(conn, buf: np.ndarray, back: np.ndarray, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        conn.call({"op": "echo"}, [buf], reply_into=[memoryview(back)]).release()
    return 2 * buf.nbytes * n / (time.perf_counter() - t0)


def rows(args=None) -> list[dict]:
    from rgpu import config
    from rgpu.transport.client import connect

    quick = getattr(args, "quick", False)
    repeats = 3 if quick else max(3, getattr(args, "repeats", 5) or 5)
    sizes = SIZES[:2] if quick else SIZES
    folder = tempfile.mkdtemp(prefix="rgpu-bench-tls-")
    plain, secure = _Server(folder), _Server(folder, "--tls")
    try:
        base = config.settings(environ={}, token="bench", transport="tcp")
        conns = {"tcp": connect("echo", settings=base.with_(server=plain.address)),
                 "tcp+tls": connect("echo", settings=base.with_(server=secure.address,
                                                                tls_fingerprint=secure.fingerprint))}
        version = conns["tcp+tls"].transport.sock.version() + " " + conns["tcp+tls"].transport.sock.cipher()[0]
        bufs = {n: (np.ones(n, np.uint8), np.empty(n, np.uint8)) for n in sizes}
        figures = {  # metric -> (unit, size, per-connection measurement); bigger sizes fewer times
            "round trip, request without buffers": ("us", 0, lambda c: _round_trip(c, 200) * 1e6),
            "small post (64 B), batched": ("us", 64, lambda c: _post(c) * 1e6),
        }
        for n in sizes:
            times = max(2, (256 << 20) // n // 8)
            label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
            figures[f"upload {label}"] = ("GB/s", n, lambda c, n=n, k=times: _upload(c, bufs[n][0], k) / 1e9)
            figures[f"echo {label}, both ways"] = (
                "GB/s", n, lambda c, n=n, k=times: _echo(c, bufs[n][0], bufs[n][1], k) / 1e9)
        for conn in conns.values():  # warm: pools filled, code paths hot
            for _, _, fn in figures.values():
                fn(conn)
        got = {(m, name): [] for m in figures for name in conns}
        for _ in range(repeats):
            for metric, (_, _, fn) in figures.items():
                for name, conn in conns.items():
                    got[(metric, name)].append(fn(conn))
        for conn in conns.values():
            conn.close()
    finally:
        plain.stop()
        secure.stop()
    out = []
    for metric, (unit, size, _) in figures.items():
        tls_runs, tcp_runs = got[(metric, "tcp+tls")], got[(metric, "tcp")]
        value, baseline = statistics.median(tls_runs), statistics.median(tcp_runs)
        out.append({"bench": "transport", "transport": "tcp+tls", "metric": metric, "unit": unit, "size": size,
                    "value": value, "baseline_name": "tcp (plain, same run)", "baseline": baseline,
                    "ratio": value / baseline, "spread": [min(tls_runs), max(tls_runs)],
                    "baseline_spread": [min(tcp_runs), max(tcp_runs)], "tls": version})
    return out


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    out = rows(args)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"TLS: {out[0]['tls']}")
    for r in out:
        lo, hi = r["spread"]
        blo, bhi = r["baseline_spread"]
        print(f"{r['metric']:32s} tls {r['value']:8.2f} [{lo:.2f}-{hi:.2f}]  tcp {r['baseline']:8.2f} "
              f"[{blo:.2f}-{bhi:.2f}] {r['unit']:5s} tls/tcp {r['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
