"""shm and ucx for ``rgpu bench transport``, each beside its own baseline; and the parallel copy beside copyto.

    rgpu bench transport --transport tcp,shm,ucx [--json] [--quick] [--plot PNG]   (rows from bench/transport.py)
    python -m rgpu.bench.transport_fast [--json] [--quick] [--repeats N] [--copy] [--plot PNG]
    python -m rgpu.bench.transport_fast --plot-json ROWS.json --plot PNG        (two panels: up, down)

Registered with ``bench/transport.py`` (same harness, same rows, client and server
pinned to different cores, rgpu and baseline interleaved):

- ``shm``: bandwidth (upload, the server sums sampled bytes where they arrived:
  in place) and download (``fill`` into a caller buffer: the copy out is counted)
  beside one-thread ``numpy.copyto`` of the same buffer into a warm destination
  that then sums the same samples: shm copies each uploaded byte once, so the
  ideal ratio is 1. rtt beside rgpu's own tcp.
- ``ucx``: the same verbs beside raw UCXX at its best setting here
  (worker-address endpoints, no error handling, polling progress while a
  transfer is on, a child process receiving into one preallocated buffer; idle,
  it sleeps on the worker's events, as the rgpu worker that shares its core does).

``--copy`` rows: the jitted ``prange`` copy (``transport/fastcopy.py``) beside
one-thread ``numpy.copyto``, 4-256 MiB; ``used_by_shm`` says whether this host's
shm uses it (cores >= fastcopy.MIN_CORES).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from . import harness
from . import transport as tb

COPY_SIZES = (4 << 20, 16 << 20, 64 << 20, 256 << 20)


class CopyBaseline(tb.Backend):
    """What one copy costs: ``numpy.copyto`` on one thread into memory reused run after run."""

    name = "numpy.copyto (one thread)"

    def __init__(self):
        self._dst = np.empty(0, np.uint8)
        self._fill = np.empty(0, np.uint8)

    def upload(self, src, stride):
        n = src.nbytes
        if self._dst.nbytes < n:
            self._dst = np.empty(n, np.uint8)
            self._dst[:] = 0                     # faulted in once, as the segment's pages are
        dst = self._dst[:n]
        np.copyto(dst, np.frombuffer(src, np.uint8))
        return tb.sampled_sum(dst, stride)

    def download(self, dest):
        n = dest.nbytes
        if self._fill.nbytes < n:
            self._fill = np.arange(n, dtype=np.uint8)
        np.copyto(np.frombuffer(dest, np.uint8), self._fill[:n])


# ---- raw UCXX: the ucx baseline -----------------------------------------------------------

RAW_UCX_PEER = r"""
import os, sys, struct, numpy as np
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx._lib.libucxx as u
from ucxx._lib.arr import Array
ctx = u.UCXContext(feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
w = u.UCXWorker(ctx)
w.init_blocking_progress_mode()
print(w.address.tobytes().hex(), flush=True)
ep = w.create_endpoint_from_worker_address(u.UCXAddress.create_from_buffer(bytes.fromhex(sys.argv[1])), False)
head, word, ping = bytearray(17), np.zeros(1, np.uint64), bytearray(64)
sink, fill = np.empty(0, np.uint8), np.empty(0, np.uint8)
def wait(*reqs):
    while not all(r.completed for r in reqs):
        w.progress()
    for r in reqs:
        r.check_error()
def idle(req):  # between requests: sleep on the worker's events, not poll (the rgpu worker shares our core)
    while not req.completed:
        w.progress_worker_event(epoll_timeout=10)
    req.check_error()
while True:
    idle(w.tag_recv(Array(head), u.UCXXTag(1)))
    op, size, stride = struct.unpack("<cQQ", head)
    if op == b"Q":
        break
    if op == b"U":
        if sink.nbytes < size:
            sink = np.empty(size, np.uint8)
        wait(w.tag_recv(Array(sink[:size]), u.UCXXTag(2)))
        word[0] = int(sink[:size][::stride].sum(dtype=np.uint64))
        wait(ep.tag_send(Array(word), u.UCXXTag(3)))
    elif op == b"D":
        if fill.nbytes < size:
            fill = np.arange(size, dtype=np.uint8)
        wait(ep.tag_send(Array(fill[:size]), u.UCXXTag(4)))
    else:
        wait(w.tag_recv(Array(ping), u.UCXXTag(5)))
        wait(ep.tag_send(Array(ping), u.UCXXTag(6)))
"""


class RawUcx(tb.Backend):
    """Raw UCXX to a peer process: worker-address endpoints without error handling, polling progress."""

    name = "raw UCXX (worker address)"

    def __init__(self, cpus=None):
        import struct

        from rgpu.transport import ucx

        self._pack = struct.Struct("<cQQ").pack
        lib, self.A = ucx._ucxx()
        self.u = lib
        self.ctx = lib.UCXContext(feature_flags=(lib.Feature.TAG,))
        self.w = lib.UCXWorker(self.ctx)
        self.proc = harness.spawn([sys.executable, "-c", RAW_UCX_PEER, self.w.address.tobytes().hex()], cpus,
                                  stdout=tb.subprocess.PIPE, text=True)
        peer = bytes.fromhex(self.proc.stdout.readline().strip())
        self.ep = self.w.create_endpoint_from_worker_address(lib.UCXAddress.create_from_buffer(peer), False)
        self.word = np.zeros(1, np.uint64)
        self.out, self.back = np.zeros(64, np.uint8), np.zeros(64, np.uint8)

    def _wait(self, *reqs) -> None:
        while not all(r.completed for r in reqs):
            self.w.progress()
        for r in reqs:
            r.check_error()

    def _head(self, op: bytes, size: int, stride: int = 0):
        return self.ep.tag_send(self.A(bytearray(self._pack(op, size, stride))), self.u.UCXXTag(1))

    def upload(self, src, stride):
        self._wait(self._head(b"U", src.nbytes, stride), self.ep.tag_send(self.A(src), self.u.UCXXTag(2)),
                   self.w.tag_recv(self.A(self.word), self.u.UCXXTag(3)))
        return int(self.word[0])

    def download(self, dest):
        self._wait(self._head(b"D", dest.nbytes), self.w.tag_recv(self.A(dest), self.u.UCXXTag(4)))

    def ping(self):
        self._wait(self._head(b"P", 64), self.ep.tag_send(self.A(self.out), self.u.UCXXTag(5)),
                   self.w.tag_recv(self.A(self.back), self.u.UCXXTag(6)))

    def close(self):
        try:
            self._wait(self._head(b"Q", 0))
            self.proc.wait(10)
        except Exception:  # noqa: BLE001 - the peer is ours to end either way
            self.proc.kill()
            self.proc.wait()


def shm_pairs(ctx: tb.Context) -> dict:
    rgpu = ctx.own(tb.RgpuEcho("shm", *ctx.rgpu_server()))
    copy = CopyBaseline()
    return {"bandwidth": (rgpu, copy), "download": (rgpu, copy),
            "rtt": (rgpu, ctx.own(tb.RgpuEcho("tcp", *ctx.rgpu_server())))}


def ucx_pairs(ctx: tb.Context) -> dict:
    rgpu = ctx.own(tb.RgpuEcho("ucx", *ctx.rgpu_server()))
    raw = ctx.own(RawUcx(ctx.server_cpus))
    return {"bandwidth": (rgpu, raw), "download": (rgpu, raw), "rtt": (rgpu, raw)}


def _register() -> None:
    from rgpu.transport import negotiate

    if negotiate.unavailable("shm") is None:
        tb.register("shm", shm_pairs)
    if negotiate.unavailable("ucx") is None:
        tb.register("ucx", ucx_pairs)


_register()


# ---- the parallel copy --------------------------------------------------------------------

def copy_rows(args=None) -> list[dict]:
    """numba ``prange`` copy beside one-thread ``numpy.copyto``: whether the parallel copy wins on this host."""
    from rgpu.transport import fastcopy

    quick = getattr(args, "quick", False)
    repeats = harness.repeats_of(args)
    out = []
    for size in COPY_SIZES[:2] if quick else COPY_SIZES:
        src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        try:
            fastcopy.parallel_copy(dst, src)
        except RuntimeError:
            return []
        k = max(2, (512 << 20) // size)

        def timed(fn):
            def run():
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                return size * k / (time.perf_counter() - t0) / 1e9
            return run
        result = harness.compare(timed(lambda: fastcopy.parallel_copy(dst, src)),
                                 timed(lambda: np.copyto(dst, src)), repeats)
        out.append(harness.row("transport", "copy", "bandwidth", size, result, "numpy.copyto (one thread)",
                               copy="numba prange", cores=fastcopy.cores(), used_by_shm=fastcopy.backend() != "memcpy"))
    return out


def plot(rows: list[dict], path: str) -> str:
    """Upload and download bandwidth against size: rgpu per transport (solid), each one's baseline (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    colors = {"tcp": "tab:blue", "shm": "tab:green", "ucx": "tab:red", "tcp+tls": "tab:purple"}
    for ax, direction in zip(axes, (None, "download")):
        for t in sorted({r["transport"] for r in rows if r["metric"] == "bandwidth"}):
            pts = sorted((r["size"], r["value"], r["baseline"], r["baseline_name"]) for r in rows
                         if r["metric"] == "bandwidth" and r["transport"] == t and r.get("direction") == direction)
            if not pts:
                continue
            c = colors.get(t, "tab:gray")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=c, label=f"rgpu {t}")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=c, alpha=0.6, label=f"  beside {pts[0][3]}")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["size"] for r in rows if r["metric"] == "bandwidth"})
        ax.set_xticks(ticks, [harness.label(t) for t in ticks], rotation=45)
        ax.set_title("download (into caller memory)" if direction else "upload (read where it arrived)")
        ax.set_xlabel("message size")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s, median of interleaved runs")
    axes[0].legend(fontsize=8)
    fig.suptitle("rgpu transports on one host (solid) beside their baselines (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


FLAGS = {
    "--sizes": {"help": "comma list of sizes, e.g. 64,1M,64M"},
    "--transport": {"default": "tcp,shm,ucx", "help": "those of them available here"},
    "--copy": {"action": "store_true", "help": "only the parallel copy beside copyto"},
    "--plot": {"help": "write the PNG here"},
    "--plot-json": {"help": "plot saved rows (--json output) to --plot, measure nothing"},
}


def _rows(args) -> list[dict]:
    if args.copy:
        return copy_rows(args)
    args.transport = ",".join(n for n in args.transport.split(",") if n in tb.TRANSPORTS)
    return harness.run_suite("transport", args)


def main(argv=None) -> int:
    args = harness.parser(__doc__, flags=FLAGS).parse_args(argv)
    if args.plot_json:
        print(plot(json.load(open(args.plot_json)), args.plot or "transport_fast.png"))
        return 0
    return harness.show(_rows(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
