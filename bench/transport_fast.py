"""The zero-copy transports beside their baselines, same run, interleaved: shm and ucx.

    rgpu bench transport --transport shm,ucx --json       (harness: these rows beside the tcp rows)
    python -m rgpu.bench.transport_fast [--json] [--quick] [--repeats N] [--transport tcp,shm,ucx] [--plot F]

One local server (echo route); one client connection per transport, forced by
name. Figures, each the median of ``repeats`` interleaved runs (``spread`` is
[min, max]):

- upload N bytes (``checksum`` reading one byte: the bytes go one way, the server
  reads them in place where the transport allows) per transport and size, beside
  one-thread ``numpy.copyto`` of the same buffer into a warm destination: shm
  copies each byte once, so the ideal ratio is 1;
- round trip of a request carrying 64 B, shm beside rgpu's own tcp;
- ucx upload beside raw UCXX at its best setting here (worker-address endpoints,
  no error handling, a child process receiving into one preallocated buffer);
- the parallel copy (numba ``prange``) beside ``numpy.copyto``, 64 MiB.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = (64 << 10, 1 << 20, 16 << 20, 64 << 20)
QUICK_SIZES = (1 << 20, 64 << 20)
RTT_CALLS = 400


def label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def row(transport, metric, unit, size, runs, baseline_name, base_runs, **extra) -> dict:
    value, baseline = statistics.median(runs), statistics.median(base_runs)
    return {"bench": "transport", "transport": transport, "metric": metric, "unit": unit, "size": size,
            "value": value, "baseline_name": baseline_name, "baseline": baseline,
            "ratio": value / baseline if baseline else None, "spread": [min(runs), max(runs)],
            "baseline_spread": [min(base_runs), max(base_runs)], **extra}


class LocalServer:
    """``rgpu serve`` on a free loopback port, echo route, its own token; stopped by ``stop()``."""

    def __init__(self, host: str = "127.0.0.1", argv_prefix: list[str] | None = None):
        folder = tempfile.mkdtemp(prefix="rgpu-bench-fast-")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        env.update(RGPU_TOKEN="bench", RGPU_TOKEN_FILE=os.path.join(folder, "token"))
        cmd = [*(argv_prefix or []), sys.executable, "-m", "rgpu", "serve", "--host", host, "--port", "0",
               "--preload", ""]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"rgpu serve did not start: {line}")
        self.address = line.split("listening on ")[1].split(";")[0].strip()

    def connect(self, transport: str):
        from rgpu import config
        from rgpu.transport.client import connect

        return connect("echo", settings=config.settings(environ={}, server=self.address, token="bench",
                                                        transport=transport))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---- measurements (each returns one figure) ------------------------------------------

def upload(conn, buf: np.ndarray, n: int) -> float:
    """GB/s of ``n`` requests carrying ``buf`` that the server acknowledges after reading one byte."""
    t0 = time.perf_counter()
    for _ in range(n):
        conn.call({"op": "checksum", "stride": 1 << 40}, [buf]).release()
    return buf.nbytes * n / (time.perf_counter() - t0) / 1e9


def copyto(src: np.ndarray, dst: np.ndarray, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(dst, src)
    return src.nbytes * n / (time.perf_counter() - t0) / 1e9


def round_trip(conn, n: int = RTT_CALLS) -> float:
    """Median microseconds of a request carrying 64 B, answered with its size."""
    small = b"x" * 64
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.call({"op": "sizes"}, [small]).release()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def times_for(n: int) -> int:
    return max(3, min(200, (512 << 20) // n // 4))


def interleave(figures: dict, repeats: int) -> dict:
    """Run each named figure once per repeat, in turn; after one warm-up run of each."""
    for fn in figures.values():
        fn()
    got = {name: [] for name in figures}
    for _ in range(repeats):
        for name, fn in figures.items():
            got[name].append(fn())
    return got


# ---- raw UCXX: the baseline for ucx ----------------------------------------------------

RAW_UCX_PEER = r"""
import os, sys, numpy as np
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx._lib.libucxx as u
from ucxx._lib.arr import Array
ctx = u.UCXContext(feature_flags=(u.Feature.TAG,))
w = u.UCXWorker(ctx)
print(w.address.tobytes().hex(), flush=True)
peer, size = sys.stdin.readline().split()
ep = w.create_endpoint_from_worker_address(u.UCXAddress.create_from_buffer(bytes.fromhex(peer)), False)
buf, ack = np.empty(int(size), np.uint8), np.zeros(8, np.uint8)
def wait(r):
    while not r.completed:
        w.progress()
    r.check_error()
while True:
    wait(w.tag_recv(Array(ack), u.UCXXTag(2)))
    if ack[0] == 0:
        break
    wait(w.tag_recv(Array(buf), u.UCXXTag(1)))
    wait(ep.tag_send(Array(ack), u.UCXXTag(3)))
"""


class RawUcx:
    """The client end of raw UCXX: sends one buffer, waits for an 8-byte answer (as rgpu's upload)."""

    def __init__(self, size: int):
        from rgpu.transport import ucx

        lib, self.Array = ucx._ucxx()
        self.u = lib
        self.ctx = lib.UCXContext(feature_flags=(lib.Feature.TAG,))
        self.w = lib.UCXWorker(self.ctx)
        self.proc = subprocess.Popen([sys.executable, "-c", RAW_UCX_PEER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        peer = bytes.fromhex(self.proc.stdout.readline().strip())
        self.proc.stdin.write(f"{self.w.address.tobytes().hex()} {size}\n")
        self.proc.stdin.flush()
        self.ep = self.w.create_endpoint_from_worker_address(lib.UCXAddress.create_from_buffer(peer), False)
        self.go, self.ack = np.ones(8, np.uint8), np.zeros(8, np.uint8)

    def _wait(self, reqs) -> None:
        while not all(r.completed for r in reqs):
            self.w.progress()
        for r in reqs:
            r.check_error()

    def upload(self, buf: np.ndarray, n: int) -> float:
        u, A = self.u, self.Array
        t0 = time.perf_counter()
        for _ in range(n):
            self._wait([self.ep.tag_send(A(self.go), u.UCXXTag(2)), self.ep.tag_send(A(buf), u.UCXXTag(1)),
                        self.w.tag_recv(A(self.ack), u.UCXXTag(3))])
        return buf.nbytes * n / (time.perf_counter() - t0) / 1e9

    def stop(self) -> None:
        try:
            self._wait([self.ep.tag_send(self.Array(np.zeros(8, np.uint8)), self.u.UCXXTag(2))])
            self.proc.wait(10)
        except Exception:
            self.proc.kill()


# ---- the rows --------------------------------------------------------------------------

def available(name: str) -> bool:
    from rgpu.transport import negotiate

    return negotiate.unavailable(name) is None


def rows(args=None) -> list[dict]:
    from rgpu.transport import fastcopy

    quick = getattr(args, "quick", False)
    repeats = 3 if quick else max(3, getattr(args, "repeats", 5) or 5)
    sizes = QUICK_SIZES if quick else SIZES
    wanted = [t for t in (getattr(args, "transport", None) or "tcp,shm,ucx").split(",") if t]
    names = [t for t in ("tcp", "shm", "ucx") if t in wanted and available(t)]
    if "tcp" not in names:
        names.insert(0, "tcp")   # rgpu's tcp round trip is the shm round trip's baseline
    server = LocalServer()
    conns = {}
    out: list[dict] = []
    try:
        conns = {t: server.connect(t) for t in names}
        for t, c in conns.items():
            assert c.transport_name == t, f"asked for {t}, got {c.transport_name}"
        bufs = {n: np.ones(n, np.uint8) for n in sizes}
        dsts = {n: np.empty(n, np.uint8) for n in sizes}
        for n in sizes:
            k = times_for(n)
            figs = {"numpy.copyto": lambda n=n, k=k: copyto(bufs[n], dsts[n], k)}
            figs.update({t: (lambda c=c, n=n, k=k: upload(c, bufs[n], k)) for t, c in conns.items()})
            got = interleave(figs, repeats)
            for t in conns:
                out.append(row(t, f"upload {label(n)}", "GB/s", n, got[t], "one-thread numpy.copyto, same run",
                               got["numpy.copyto"], copy=fastcopy.backend() if t == "shm" else None))
        if "shm" in conns:
            got = interleave({t: (lambda c=conns[t]: round_trip(c)) for t in ("tcp", "shm")}, repeats)
            out.append(row("shm", "round trip, 64 B request", "us", 64, got["shm"], "rgpu tcp, same run", got["tcp"],
                           spin_us=_spin_us()))
        if "ucx" in conns:
            out += _ucx_rows(conns["ucx"], sizes[-1], repeats)
        out += copy_rows(sizes[-1], repeats)
    finally:
        for c in conns.values():
            c.close()
        server.stop()
    return out


def _spin_us() -> float:
    from rgpu.transport.shm import ShmTransport

    return ShmTransport.spin_s * 1e6


def _ucx_rows(conn, size: int, repeats: int) -> list[dict]:
    buf = np.ones(size, np.uint8)
    raw = RawUcx(size)
    try:
        k = times_for(size)
        got = interleave({"rgpu": lambda: upload(conn, buf, k), "raw": lambda: raw.upload(buf, k)}, repeats)
    finally:
        raw.stop()
    return [row("ucx", f"upload {label(size)} vs raw UCXX", "GB/s", size, got["rgpu"],
                "raw UCXX, worker-address endpoints, same run", got["raw"])]


def copy_rows(size: int, repeats: int) -> list[dict]:
    """The parallel copy beside one-thread copyto: whether numba wins here (fastcopy uses it where it does)."""
    from rgpu.transport import fastcopy

    src, dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
    try:
        fastcopy.parallel_copy(dst, src)
    except RuntimeError:
        return []
    k = times_for(size)

    def parallel():
        t0 = time.perf_counter()
        for _ in range(k):
            fastcopy.parallel_copy(dst, src)
        return size * k / (time.perf_counter() - t0) / 1e9
    got = interleave({"numba": parallel, "copyto": lambda: copyto(src, dst, k)}, repeats)
    return [row("copy", f"numba prange copy {label(size)}", "GB/s", size, got["numba"],
                "one-thread numpy.copyto, same run", got["copyto"], cores=fastcopy.cores(),
                used_by_shm=fastcopy.backend() != "memcpy")]


def plot(rows_: list[dict], path: str) -> None:
    """Bandwidth against size: one line per transport, the copyto baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ups = [r for r in rows_ if r["metric"].startswith("upload ") and "vs" not in r["metric"] and r["unit"] == "GB/s"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for t in sorted({r["transport"] for r in ups}):
        pts = sorted((r["size"], r["value"]) for r in ups if r["transport"] == t)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"rgpu {t}")
    base = sorted({(r["size"], r["baseline"]) for r in ups})
    if base:
        ax.plot([p[0] for p in base], [p[1] for p in base], "k--", label="numpy.copyto (one thread)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per request")
    ax.set_ylabel("GB/s (upload, median)")
    ax.set_title("rgpu transports on one host")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def format_rows(rows_: list[dict]) -> str:
    lines = []
    for r in rows_:
        lo, hi = r["spread"]
        lines.append(f"{r['transport']:5s} {r['metric']:34s} {r['value']:9.2f} [{lo:.2f}-{hi:.2f}] {r['unit']:4s} "
                     f"vs {r['baseline_name']}: {r['baseline']:.2f}  ratio {r['ratio']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transport", default=None, help="comma list of tcp, shm, ucx (default: all available)")
    p.add_argument("--plot", default=None, help="write the bandwidth-against-size PNG here")
    args = p.parse_args(argv)
    out = rows(args)
    if args.plot:
        plot(out, args.plot)
    print(json.dumps(out, indent=1) if args.json else format_rows(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
