"""``rgpu bench transport``: bandwidth from 64 B to 256 MiB and a 64 B round trip, beside a raw socket pair.

    rgpu bench transport [--json] [--quick] [--sizes 64,1M,64M] [--repeats 5] [--plot PNG] [--server host:port]
    python -m rgpu.bench.transport [same flags]

- ``bandwidth`` (upload): N bytes from an ordinary numpy buffer until the receiver owns
  them, proved by a sum of sampled bytes the receiver computes and the client checks;
  rgpu: a ``checksum`` request on the echo route. ``direction: download`` rows: the
  echo route's ``fill`` reply received into a preallocated buffer, checked the same way.
- ``rtt``: 64 B there and back; rgpu: an ``echo`` request replying into a preallocated buffer.
  A run's figure is the median of its round trips (on a shared machine a mean mostly
  measures who else was scheduled); each row is the median of the runs.
- baseline ``raw socket``: a Python socket pair in two processes, ``sendmsg`` of a small
  size header with the bytes (then ``sendall`` of what is left) and ``recv_into`` a
  preallocated buffer, the same sampled sum; a raw 64 B ping-pong.

The client (this process) and the servers (``rgpu serve``, the raw server) are pinned to
different cores (``harness.cpu_split``), as two hosts would be; ``--no-pin`` leaves placement
to the scheduler (on a busy shared machine pinned processes cannot dodge the load). With
``--server`` the rgpu server is yours; the
raw baseline then runs on loopback here, so its ratio means something only for a local server.

Transports are a registry: ``TRANSPORTS[name](ctx)`` gives, per metric, the rgpu backend
and its baseline, both with the verbs of ``Backend``. Another transport registers itself
from its own bench module (``register("shm", pairs)`` in ``rgpu.bench.<module>``, named in
``EXTRA_MODULES``) and its rows come out beside tcp's with its own baselines.
"""
from __future__ import annotations

import argparse
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Callable

import numpy as np

from . import harness

SIZES = (64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20)
QUICK_SIZES = (64, 64 << 10, 1 << 20, 64 << 20)
SAMPLES = 4093          # bytes summed per transfer: the proof of arrival costs the same at every size
RUN_SECONDS = 0.15      # work per run (quick: a third of it), cut into SLICES alternating slices
SLICES = 3
PING_BYTES = 64
EXTRA_MODULES = ("rgpu.bench.transport_fast", "rgpu.bench.transport_resume")  # modules that register more transports


def stride_for(size: int) -> int:
    return max(1, size // SAMPLES)


def sampled_sum(buf, stride: int) -> int:
    return int(np.frombuffer(buf, np.uint8)[::stride].sum(dtype=np.uint64))


class Backend:
    """One side of a comparison; rgpu and every baseline offer the same verbs."""

    name = "backend"

    def upload(self, src: memoryview, stride: int) -> int:
        """Send ``src``; return the receiver's sum of every ``stride``-th byte once it holds them all."""
        raise NotImplementedError

    def download(self, dest: memoryview) -> None:
        """Receive ``len(dest)`` bytes (byte i is i % 256) into ``dest``."""
        raise NotImplementedError

    def ping(self) -> None:
        """64 B there and 64 B back."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class RgpuEcho(Backend):
    """rgpu through ``rgpu serve``'s echo route on the named transport."""

    CHECKSUM, ECHO = "checksum", {"op": "echo"}

    def __init__(self, transport: str, address: str, token: str):
        from rgpu import config
        from rgpu.transport.client import connect

        self.name = f"rgpu {transport}"
        self.conn = connect("echo", settings=config.settings(server=address, token=token, transport=transport))
        if self.conn.transport_name != transport:
            raise RuntimeError(f"asked for {transport}, got {self.conn.transport_name}")
        self._out = [np.arange(PING_BYTES, dtype=np.uint8)]       # reused, as the raw baseline reuses its bytes
        self._back = [memoryview(bytearray(PING_BYTES))]

    def upload(self, src, stride):
        reply = self.conn.call({"op": "checksum", "stride": stride}, [src])
        return reply.meta["sums"][0]

    def download(self, dest):
        self.conn.call({"op": "fill", "n": dest.nbytes}, reply_into=[dest])

    def ping(self):
        self.conn.call(self.ECHO, self._out, reply_into=self._back)

    def close(self):
        self.conn.close()


class RawSocket(Backend):
    """The baseline: plain sockets to ``raw_server`` in another process (TCP_NODELAY, as rgpu)."""

    name = "raw socket"

    def __init__(self, host: str, port: int):
        self._bulk = self._open(host, port, b"B")
        self._pinger = self._open(host, port, b"P")
        self._out, self._back = bytes(PING_BYTES), bytearray(PING_BYTES)
        self._word = bytearray(8)

    @staticmethod
    def _open(host, port, mode: bytes) -> socket.socket:
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(mode)
        return s

    def upload(self, src, stride):
        head = struct.pack("<cQQ", b"U", src.nbytes, stride)
        sent = self._bulk.sendmsg([head, src])  # header and bytes in one scatter write, as rgpu sends a frame
        if sent < len(head):
            self._bulk.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < src.nbytes:
            self._bulk.sendall(src[sent - len(head):])
        _recv_exactly(self._bulk, memoryview(self._word))
        return struct.unpack("<Q", self._word)[0]

    def download(self, dest):
        self._bulk.sendall(struct.pack("<cQQ", b"D", dest.nbytes, 0))
        _recv_exactly(self._bulk, dest)

    def ping(self):
        self._pinger.sendall(self._out)
        _recv_exactly(self._pinger, memoryview(self._back))

    def close(self):
        self._bulk.close()
        self._pinger.close()


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the raw peer closed")
        got += k


# ---- the raw server (a child process) -------------------------------------------------------------

def raw_server(host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve raw baseline connections forever: ``B`` bulk (upload / download), ``P`` 64 B ping-pong."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(8)
    print(f"raw server on {host}:{listener.getsockname()[1]}", flush=True)
    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_raw_session, args=(sock,), daemon=True).start()


def _raw_session(sock: socket.socket) -> None:
    try:
        mode = sock.recv(1)
        if mode == b"P":
            buf = bytearray(PING_BYTES)
            while True:
                _recv_exactly(sock, memoryview(buf))
                sock.sendall(buf)
        sink = np.empty(0, np.uint8)         # both grown once and reused: no page faults after the first
        fill = np.empty(0, np.uint8)
        head = bytearray(17)
        while True:
            _recv_exactly(sock, memoryview(head))
            op, size, stride = struct.unpack("<cQQ", head)
            if op == b"U":
                if sink.nbytes < size:
                    sink = np.empty(size, np.uint8)
                view = memoryview(sink)[:size]
                _recv_exactly(sock, view)
                sock.sendall(struct.pack("<Q", sampled_sum(view, stride)))
            else:
                if fill.nbytes < size:
                    fill = np.arange(size, dtype=np.uint8)  # byte i is i % 256, as the echo route's fill
                sock.sendall(memoryview(fill)[:size])
    except (ConnectionError, OSError):
        pass
    finally:
        sock.close()


# ---- the registry of transports -------------------------------------------------------------------

class Context:
    """What the pairs of a run share: the local rgpu server, the raw server, the CPU split; closed at the end."""

    def __init__(self, args):
        self.args = args
        self.split = harness.cpu_split() if getattr(args, "pin", True) else None
        self.client_cpus, self.server_cpus = self.split if self.split else (None, None)
        self._server = None
        self._raw = None
        self._closers: list[Callable[[], None]] = []

    def rgpu_server(self) -> tuple[str, str]:
        """(address, token) of the rgpu server: ``--server`` (token from the settings) or a local one."""
        if getattr(self.args, "server", None):
            from rgpu import config
            from rgpu.transport import tokens
            return self.args.server, tokens.read_token(config.settings()).decode()
        if self._server is None:
            self._server = harness.LocalServer(cpus=self.server_cpus)
            self._closers.append(self._server.stop)
        return self._server.address, self._server.token

    def raw_server(self) -> tuple[str, int]:
        if self._raw is None:
            proc = harness.spawn([sys.executable, "-m", "rgpu.bench.transport", "--raw-server"], self.server_cpus,
                                 stdout=subprocess.PIPE, text=True)
            line = proc.stdout.readline()
            if "raw server on" not in line:
                proc.kill()
                raise RuntimeError(f"the raw baseline server did not start: {line!r}")
            host, port = line.split()[-1].rsplit(":", 1)
            self._raw = (host, int(port))
            self._closers.append(lambda: (proc.kill(), proc.wait()))
        return self._raw

    def own(self, backend: Backend) -> Backend:
        self._closers.append(backend.close)
        return backend

    def close(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - closing what is left; report nothing
                pass

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tcp_pairs(ctx: Context) -> dict:
    """tcp: rgpu beside the raw socket pair, for every metric."""
    rgpu = ctx.own(RgpuEcho("tcp", *ctx.rgpu_server()))
    raw = ctx.own(RawSocket(*ctx.raw_server()))
    return {"bandwidth": (rgpu, raw), "download": (rgpu, raw), "rtt": (rgpu, raw)}


TRANSPORTS: dict[str, Callable[[Context], dict]] = {"tcp": tcp_pairs}


def register(name: str, pairs: Callable[[Context], dict]) -> None:
    """Add a transport: ``pairs(ctx)`` returns {"bandwidth"|"download"|"rtt": (rgpu backend, baseline)}."""
    TRANSPORTS[name] = pairs


def _load_extras() -> None:
    import importlib
    for module in EXTRA_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            pass


# ---- measuring ------------------------------------------------------------------------------------

def _runs_for(seconds_per_call: float, budget: float) -> int:
    return max(1, min(5000, int(budget / max(seconds_per_call, 1e-7))))


def _bandwidth_fn(backend: Backend, src: np.ndarray, k: int) -> Callable[[], float]:
    view, stride = memoryview(src), stride_for(src.nbytes)
    expected = sampled_sum(src, stride)

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            got = backend.upload(view, stride)
            if got != expected:
                raise RuntimeError(f"{backend.name}: checksum {got} != {expected}: bytes lost or changed")
        return src.nbytes * k / (time.perf_counter() - t0) / 1e9
    return run


def _download_fn(backend: Backend, dest: np.ndarray, k: int) -> Callable[[], float]:
    view, stride = memoryview(dest), stride_for(dest.nbytes)
    expected = sampled_sum(np.arange(dest.nbytes, dtype=np.uint8), stride)

    def run() -> float:
        dest[:] = 0
        t0 = time.perf_counter()
        for _ in range(k):
            backend.download(view)
        seconds = time.perf_counter() - t0
        if sampled_sum(view, stride) != expected:  # checked once a run: the receiver is this process
            raise RuntimeError(f"{backend.name}: downloaded bytes differ")
        return dest.nbytes * k / seconds / 1e9
    return run


def _rtt_fn(backend: Backend, k: int) -> Callable[[], float]:
    """A run: ``k`` round trips; its figure is their median (a preempted call on a shared machine is not the rtt)."""
    def run() -> float:
        times = [0.0] * k
        clock, ping = time.perf_counter, backend.ping
        for i in range(k):
            t0 = clock()
            ping()
            times[i] = clock() - t0
        times.sort()
        return times[k // 2] * 1e6
    return run


def _calibrate(fn_one: Callable[[], None]) -> float:
    fn_one()                                   # first touch: pages, pool buffers, caches
    t0 = time.perf_counter()
    fn_one()
    return time.perf_counter() - t0


def transport_rows(name: str, pairs: dict, sizes, repeats: int, budget: float) -> list[dict]:
    out = []
    if "rtt" in pairs:
        rgpu, base = pairs["rtt"]
        for b in (rgpu, base):
            for _ in range(200):
                b.ping()
        k = _runs_for(_calibrate(base.ping), budget / SLICES)
        result = harness.compare(_rtt_fn(rgpu, k), _rtt_fn(base, k), repeats, SLICES)
        out.append(harness.row("transport", name, "rtt", PING_BYTES, result, base.name))
    for metric in ("bandwidth", "download"):
        if metric not in pairs:
            continue
        rgpu, base = pairs[metric]
        for size in sizes:
            buf = np.arange(size, dtype=np.uint8) if metric == "bandwidth" else np.zeros(size, np.uint8)
            view, stride = memoryview(buf), stride_for(size)
            one = (lambda b: lambda: b.upload(view, stride)) if metric == "bandwidth" else \
                (lambda b: lambda: b.download(view))
            _calibrate(one(rgpu))
            k = _runs_for(_calibrate(one(base)), budget / SLICES)
            make = _bandwidth_fn if metric == "bandwidth" else _download_fn
            result = harness.compare(make(rgpu, buf, k), make(base, buf, k), repeats, SLICES)
            extra = {"direction": "download"} if metric == "download" else {}
            out.append(harness.row("transport", name, "bandwidth", size, result, base.name, **extra))
            buf = view = None  # this size's buffer goes before the next is made (a name, not del: the lambdas above read it)
    return out


def rows(args=None) -> list[dict]:
    """Rows for every transport asked for (``--transport a,b``; default: every registered one)."""
    args = args or parse_args([])
    _load_extras()
    names = [n.strip() for n in (getattr(args, "transport", None) or ",".join(TRANSPORTS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown:
        from rgpu.errors import ConfigError
        raise ConfigError(f"no transport benchmark for {', '.join(unknown)}; there are: {', '.join(TRANSPORTS)}")
    quick = getattr(args, "quick", False)
    sizes = harness.parse_sizes(getattr(args, "sizes", None), QUICK_SIZES if quick else SIZES)
    repeats = harness.repeats_of(args)
    budget = RUN_SECONDS / 3 if quick else RUN_SECONDS
    out = []
    with Context(args) as ctx, harness.pinned(ctx.client_cpus):
        for name in names:
            out += transport_rows(name, TRANSPORTS[name](ctx), sizes, repeats, budget)
    return out


FLAGS = {
    "--sizes": {"help": "comma list of sizes, e.g. 64,1M,64M"},
    "--transport": {"help": "comma list (default: every registered one)"},
    "--server": {"help": "host:port of a running rgpu server (default: start a local one)"},
    "--plot": {"help": "write a bandwidth-against-size PNG here"},
    "--no-pin": {"dest": "pin", "action": "store_false", "help": "leave the processes where the scheduler puts them"},
    "--raw-server": {"action": "store_true", "help": argparse.SUPPRESS},  # the baseline's server, a child of Context
}


def parse_args(argv):
    return harness.parser(__doc__, flags=FLAGS, prog="python -m rgpu.bench.transport").parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.raw_server:
        raw_server()
        return 0
    return harness.show(harness.run_suite("transport", args), args.json)


if __name__ == "__main__":
    sys.exit(main())
