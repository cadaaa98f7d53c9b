"""``rgpu bench resilience``: an authenticated handshake while strangers flood the server's port; a session
resumed after a dropped connection.

    rgpu bench resilience --json [--repeats 7] [--flood 256] [--tls] [--resume-only] [--step small|bench]
    python -m rgpu.bench.resilience --json --flood 256 [--tls]

The flood is another process (``python -m rgpu.bench.resilience --flood-at HOST:PORT``) holding
``--flood`` connections open on the port: idle ones (connect, never a byte) and dribbling ones
(a frame header's bytes, one a second); a connection the server closes is opened again, so the
count holds however the server sheds them. It stops by itself. Value: ``connect("echo")`` (TCP
connect, the handshake to WELCOME) with the flood on; baseline: the same with no flood, the two
interleaved, each against a server that has had time to start its next spare worker. Rows: the
default bounds (the flood churns among itself), bounds above the flood (all of it held at once),
and with ``--tls`` a TLS server (its flood dribbles a TLS record).

Resuming (a server with ``RGPU_SESSION_GRACE``): value, an echo call right after the client's
connection was cut (the drop noticed, a new connection, the handshake, the resume and the call);
baseline, the plain reconnect: a new session's connect and the same call. And the cost of keeping
frames for replay: 256 posts of 4 KiB and a call, and a 1,000-op stream (small posts, one wait: an eager
step's shape), on a resumable session against a plain one (a server without a grace).

``--step PRESET``: the acknowledgements' cost on the eager nanoGPT-class training step (``rgpu bench train``'s
model; ``bench`` on a GPU host, ``small`` on a laptop's CPU): the step over tcp in a session that resumes beside
one that cannot (``RGPU_SESSION_GRACE=0``), each in a process of its own, blocks of steps alternated, their
losses checked equal. Target <= 1.01.
"""
from __future__ import annotations

import argparse
import math
import os
import secrets
import select
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rgpu.bench import harness

DEFAULT_FLOOD = 256
SETTLE_S = 1.5        # between runs: the server's next spare worker starts (no preload: about a second)
DRIBBLE = b"RGPU\x01\x00\x01\x00" + b"\x00" * 28   # a HELLO header, never finished
DRIBBLE_TLS = b"\x16\x03\x01\x02\x00\x01" + b"\x00" * 30   # a TLS record's header and a ClientHello's start


def flood(host: str, port: int, count: int, seconds: float, dribble_every: int = 2, dribble: bytes = DRIBBLE) -> None:
    """Hold ``count`` connections open on host:port for ``seconds``: every ``dribble_every``-th one sends
    a byte a second, the others nothing; one the server closes is opened again (at most ``count`` a tick)."""
    deadline = time.monotonic() + seconds
    conns: dict[int, tuple[socket.socket, int]] = {}   # fd -> (socket, bytes dribbled; -1 for idle)
    opened = 0
    poller = select.poll()
    announced = False
    while time.monotonic() < deadline:
        while len(conns) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect((host, port))
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                break
            opened += 1
            conns[s.fileno()] = (s, 0 if opened % dribble_every == 0 else -1)
            poller.register(s, select.POLLIN)
        if not announced:
            print(f"flooding {len(conns)}", flush=True)
            announced = True
        for fd, _ in poller.poll(200):   # readable: the server closed it (or refused it in a frame)
            s, _sent = conns.pop(fd)
            poller.unregister(fd)
            s.close()
        for fd, (s, sent) in list(conns.items()):
            if sent >= 0:
                try:
                    s.send(dribble[sent % len(dribble):sent % len(dribble) + 1])
                    conns[fd] = (s, sent + 1)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    conns.pop(fd)
                    poller.unregister(fd)
                    s.close()
        time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
    for s, _ in conns.values():
        s.close()
    print(f"flood over: {opened} opened", flush=True)


class Flood:
    """A flood from another process, started and waited for (it reports its connections open)."""

    def __init__(self, address: str, count: int, seconds: float = 60.0, tls: bool = False):
        self.proc = subprocess.Popen([sys.executable, "-m", "rgpu.bench.resilience", "--flood-at", address,
                                      "--flood", str(count), "--seconds", str(seconds),
                                      *(["--flood-tls"] if tls else [])],
                                     stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline()
        if not line.startswith("flooding"):
            self.stop()
            raise RuntimeError(f"the flood did not start: {line!r}")
        time.sleep(0.3)    # the last connections reach the server's accept queue

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)
        self.proc.stdout.close()


def handshake_ms(settings) -> float:
    """One authenticated connection on the echo route: TCP connect, handshake, WELCOME; closed after."""
    from rgpu.transport.client import connect

    t0 = time.perf_counter()
    conn = connect("echo", settings=settings)
    elapsed = (time.perf_counter() - t0) * 1e3
    conn.close()
    return elapsed


def _pin(token_file: Path) -> str:
    """The fingerprint of the self-signed certificate ``rgpu serve --tls`` made beside ``token_file``."""
    from rgpu.transport import tls

    pem = (token_file.parent / tls.CERT_NAME).read_text()
    return tls.fingerprint(ssl.PEM_cert_to_DER_cert(pem))


def _one(count: int, repeats: int, tls: bool = False, env: dict | None = None, what: str = "") -> dict:
    """The handshake with the flood on beside it with none, interleaved, against a fresh local server."""
    from rgpu import config
    from rgpu.local_server import LocalServer

    token = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory() as folder:
        token_file = Path(folder) / "token"
        server = LocalServer(token, ["--preload", "", "--spare-workers", "2", *(["--tls"] if tls else [])],
                             env={**_clean_env(), "RGPU_TOKEN_FILE": str(token_file), **(env or {})})
        try:
            s = config.settings(environ={}, server=server.address, token=token, transport="tcp",
                                connect_timeout=120.0, tls_fingerprint=_pin(token_file) if tls else None)
            time.sleep(SETTLE_S)
            handshake_ms(s)   # warm: the client's imports, the server's first spare

            def flooded() -> float:
                f = Flood(server.address, count, tls=tls)
                try:
                    return handshake_ms(s)
                finally:
                    f.stop()
                    time.sleep(SETTLE_S)

            def quiet() -> float:
                try:
                    return handshake_ms(s)
                finally:
                    time.sleep(SETTLE_S)

            result = harness.compare(flooded, quiet, repeats)
        finally:
            server.stop()
    return harness.row("resilience", "tcp+tls" if tls else "tcp",
                       f"authenticated handshake under a flood of {count} connections{what}", None, result,
                       "the handshake with no flood", unit="ms", delay_ms=result["value"] - result["baseline"])


def _resuming(repeats: int) -> list[dict]:
    """A resume after a drop beside a plain reconnect; posts on a resumable session beside a plain one."""
    from rgpu import config
    from rgpu.transport.client import connect
    from rgpu.local_server import LocalServer

    token = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory() as folder:
        servers = [LocalServer(token, ["--preload", "", "--spare-workers", "2"],
                               env={**_clean_env(), "RGPU_TOKEN_FILE": str(Path(folder) / "token"),
                                    "RGPU_SESSION_GRACE": grace}) for grace in ("30", "0")]
        try:
            kept, plain = (config.settings(environ={}, server=srv.address, token=token, transport="tcp",
                                           connect_timeout=120.0) for srv in servers)
            time.sleep(SETTLE_S)
            session = connect("echo", settings=kept)
            session.call({"op": "echo"}, [b"x"])

            def resumed() -> float:
                session.transport.drop()
                t0 = time.perf_counter()
                session.call({"op": "echo"}, [b"x"])
                return (time.perf_counter() - t0) * 1e3

            def reconnected() -> float:
                t0 = time.perf_counter()
                conn = connect("echo", settings=kept)
                conn.call({"op": "echo"}, [b"x"])
                elapsed = (time.perf_counter() - t0) * 1e3
                conn.close()
                time.sleep(SETTLE_S)    # its spare replaced
                return elapsed

            resume = harness.compare(resumed, reconnected, repeats)
            session.close()
            conns = [connect("echo", settings=s) for s in (kept, plain)]
            chunk = bytes(4096)

            def posts(conn) -> float:
                t0 = time.perf_counter()
                for _ in range(256):
                    conn.post({"op": "sizes"}, [chunk])
                conn.call({"op": "sizes"})
                return (time.perf_counter() - t0) * 1e3

            cost = harness.compare(lambda: posts(conns[0]), lambda: posts(conns[1]), max(repeats, 7))

            def stream(conn) -> float:   # an eager step's shape: many small ops posted, one wait at the end
                t0 = time.perf_counter()
                for _ in range(1000):
                    conn.post({"op": "sizes"})
                conn.call({"op": "sizes"})
                return (time.perf_counter() - t0) * 1e3

            ops = harness.compare(lambda: stream(conns[0]), lambda: stream(conns[1]), max(repeats, 11))
            for conn in conns:
                conn.close()
        finally:
            for srv in servers:
                srv.stop()
    return [harness.row("resilience", "tcp", "time to resume a session after a drop (to its next answer)", None,
                        resume, "a plain reconnect (a new session) and the same call", unit="ms"),
            harness.row("resilience", "tcp", "256 posts of 4 KiB and a call, frames kept for replay", None,
                        cost, "the same on a session that cannot resume", unit="ms"),
            harness.row("resilience", "tcp", "a 1,000-op stream (small posts, one wait), frames kept for replay",
                        None, ops, "the same on a session that cannot resume", unit="ms")]


STEP_BLOCK = 4   # steps a block, the two sessions' blocks alternated


def _training_step(preset: str, repeats: int) -> dict:
    """The eager training step over tcp, a resumable session beside one that cannot resume (see the module)."""
    from rgpu.bench.native_step import Native
    from rgpu.bench.train import PRESETS
    from rgpu.local_server import LocalServer

    token, vocab = secrets.token_urlsafe(32), 97
    with tempfile.TemporaryDirectory() as folder:
        servers = [LocalServer(token, ["--spare-workers", "1"],
                               env={**_clean_env(), "RGPU_TOKEN_FILE": str(Path(folder) / f"token{grace}"),
                                    "RGPU_SESSION_GRACE": grace}) for grace in ("30", "0")]
        steps = []
        try:
            for srv in servers:
                steps.append(Native("rgpu", PRESETS[preset], vocab, env={
                    **_clean_env(), "RGPU_SERVER": srv.address, "RGPU_TOKEN": token, "RGPU_TRANSPORT": "tcp"}))
            carriers = [s.info.get("transport") for s in steps]
            if carriers[0] != "ResumingTransport" or carriers[1] == "ResumingTransport":
                raise RuntimeError(f"expected a resumable session and a plain one, got {carriers}")
            losses = [s.warm(2) for s in steps]
            # the same work in both: equal losses, to 1e-5 relative (on a GPU, the backward pass's atomic adds
            # do not repeat bit for bit from one process to another; on the CPU they are equal)
            if len(losses[0]) != len(losses[1]) or not all(math.isclose(a, b, rel_tol=1e-5)
                                                           for a, b in zip(*losses)):
                raise RuntimeError(f"the two sessions' losses differ: {losses}")
            result = harness.compare(lambda: steps[0].block(STEP_BLOCK), lambda: steps[1].block(STEP_BLOCK),
                                     repeats, abba=True)
        finally:
            for s in steps:
                s.close()
            for srv in servers:
                srv.stop()
    return harness.row("resilience", "tcp", f"eager training step ({preset} preset), frames kept for replay and "
                       "acknowledged", None, result, "the same on a session that cannot resume (RGPU_SESSION_GRACE=0)",
                       unit="ms", losses=losses, target="<= 1.01")


def rows(args=None) -> list[dict]:
    repeats = 3 if getattr(args, "quick", False) else harness.repeats_of(args, 5)
    count = int(getattr(args, "flood", None) or DEFAULT_FLOOD)
    step = getattr(args, "step", None)
    if step and getattr(args, "step_only", False):
        return [_training_step(step, max(repeats, 7))]
    if getattr(args, "resume_only", False):
        return _resuming(max(repeats, 7))
    out = [_one(count, repeats),
           _one(count, repeats, env={"RGPU_MAX_UNAUTH_PER_SOURCE": str(4 * count)},
                what=" (bounds above it: every one held)")]
    if getattr(args, "tls", False):
        out.append(_one(count, repeats, tls=True))
    out += _resuming(max(repeats, 7))
    return out + ([_training_step(step, max(repeats, 7))] if step else [])


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--flood-at")
    pre.add_argument("--flood", type=int, default=DEFAULT_FLOOD)
    pre.add_argument("--seconds", type=float, default=60.0)
    pre.add_argument("--flood-tls", action="store_true")
    known, rest = pre.parse_known_args(argv)
    if known.flood_at:   # the flood's own process
        host, _, port = known.flood_at.rpartition(":")
        flood(host, int(port), known.flood, known.seconds, dribble=DRIBBLE_TLS if known.flood_tls else DRIBBLE)
        return 0
    return harness.main(rows, rest + ["--flood", str(known.flood)], __doc__, repeats=5,
                        flags={"--flood": {"type": int, "default": DEFAULT_FLOOD, "help": "connections in the flood"},
                               "--tls": {"action": "store_true", "help": "also against a TLS server"},
                               "--resume-only": {"action": "store_true", "help": "only the resume rows"},
                               "--step": {"choices": ["small", "bench"], "default": None,
                                          "help": "also the acknowledgements' cost on the eager training step of "
                                                  "this preset (bench: a GPU host's)"},
                               "--step-only": {"action": "store_true", "help": "with --step: only that row"}})


if __name__ == "__main__":
    raise SystemExit(main())
