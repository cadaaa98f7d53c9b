"""The acceptor's front door: connections before they authenticate, all in one non-blocking loop.

Until it proves the token a connection costs the server a file descriptor and a small record,
never a worker: the acceptor reads its HELLO and PROOF frames as their bytes arrive (it never
waits on one connection), answers with the CHALLENGE, and hands only an authenticated socket to a
worker, which sends WELCOME. Over TLS the handshake has to run in the process that keeps the
session (TLS state cannot cross processes), so there the gate holds a connection until its whole
first TLS record (the ClientHello) has arrived, and the worker does the rest within what is left
of the same deadline.

Bounds, each a setting: ``RGPU_AUTH_TIMEOUT`` from accept to proof; ``RGPU_MAX_UNAUTH`` connections
in the gate in all and ``RGPU_MAX_UNAUTH_PER_SOURCE`` from one address. Over a bound the gate sheds
an older connection, never the newcomer: of that address (or of all), the one that has got least
far (no complete HELLO before one that waits for its PROOF), oldest first. A flood of idle or
dribbling connections thus churns among itself while a client that answers at once gets through.
"""
from __future__ import annotations

import importlib.metadata
import logging
import selectors
import socket
import time
from dataclasses import dataclass, field

from rgpu.errors import AuthenticationError, ConnectionLost, ProtocolError, RgpuError
from rgpu.transport import handshake, tls
from rgpu.transport.base import Transport
from rgpu.transport.wire import HEADER, decode_frame, decode_header

log = logging.getLogger("rgpu.server")

ACCEPTS_PER_TURN = 64      # the listener's queue drained this far per turn, then the others get their turn
TLS_RECORD_MAX = 5 + (1 << 14) + 2048   # a record's header and its largest body (with some room)
PEEK_WAITS = (0.02, 0.05, 0.1, 0.2)     # a peeked, incomplete TLS record is looked at again after these


@dataclass(eq=False)
class Pending:
    """One connection that has not proved the token yet."""
    sock: socket.socket
    peer: tuple
    started: float
    stage: int = 0            # 0: reading HELLO (or, with TLS, the first record); 1: reading PROOF
    buf: bytearray = field(default_factory=bytearray)
    hello: handshake.Hello | None = None
    sn: bytes = b""
    peeks: int = 0            # TLS: how many times the first record was found incomplete
    wake: float = 0.0         # TLS: when to peek again (0: when readable)

    @property
    def source(self) -> str:
        return self.peer[0]


@dataclass
class Admitted:
    """A connection for a worker: ``hello`` when the gate authenticated it, None for TLS (the worker will)."""
    sock: socket.socket
    peer: tuple
    hello: handshake.Hello | None
    deadline: float
    resume_id: str | None = None   # TLS: the session the client resumes (its plain preamble said; tls.py)


class _Buffered(Transport):
    """The handshake's view of one connection: the frame the gate has read whole, and non-blocking sends
    (a handshake frame fits a fresh socket's buffer; a client that leaves it full is not worth a wait)."""
    name = "gate"

    def __init__(self, sock: socket.socket, data: bytes):
        self.sock, self.data = sock, data

    def send(self, parts) -> None:
        data = b"".join(bytes(p) for p in parts)
        try:
            sent = self.sock.send(data)
        except OSError as exc:
            raise ConnectionLost(f"sending before authentication: {exc}") from None
        if sent < len(data):
            raise ConnectionLost("the client does not read what it is sent")

    def recv_frame(self, limits, pool, into=None):
        return decode_frame(self.data, limits)

    def close(self) -> None:
        pass


def acceptor_versions() -> dict:
    """What the CHALLENGE says the server runs: the acceptor never imports torch, so torch's by its metadata."""
    versions = handshake.software_versions()
    try:
        versions.setdefault("torch", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        pass
    return versions


class Gate:
    """Accepts on ``listener`` and walks each connection through the handshake; ``turn()`` returns the
    connections ready for a worker."""

    def __init__(self, listener: socket.socket, token: bytes, settings, routes: set[str], tls_cert: dict | None):
        self.listener, self.token, self.routes, self.tls_cert = listener, token, routes, tls_cert
        self.timeout = settings.auth_timeout
        # at least one each: a bound of 0 would leave nothing to shed for the newcomer's room
        self.max_all, self.max_per_source = max(1, settings.max_unauth), max(1, settings.max_unauth_per_source)
        self.limits = handshake.HANDSHAKE_LIMITS
        self.versions = acceptor_versions()
        self.pending: dict[int, Pending] = {}
        self.by_source: dict[str, list[Pending]] = {}
        self.shed = 0                      # connections dropped by a bound, since the last report
        self._reported = time.monotonic()
        listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)

    # ---- the loop's one turn -------------------------------------------------------

    def turn(self, timeout: float) -> list[Admitted]:
        now = time.monotonic()
        wake = min((p.wake for p in self.pending.values() if p.wake), default=None)
        if wake is not None:
            timeout = max(0.0, min(timeout, wake - now))
        ready: list[Admitted] = []
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.listener:
                self._accept()
            else:
                p = self.pending.get(key.fd)
                if p is not None:
                    self._step(p, ready)
        now = time.monotonic()
        for p in list(self.pending.values()):
            if now - p.started > self.timeout:
                log.debug("connection from %s did not authenticate within %g s", p.peer, self.timeout)
                self._drop(p)
            elif p.wake and now >= p.wake:
                self._step(p, ready)
        self._report(now)
        return ready

    def close(self) -> None:
        for p in list(self.pending.values()):
            self._drop(p)
        self.selector.close()

    # ---- connections in and out ----------------------------------------------------

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:      # out of descriptors, say: shed the oldest, try again next turn
                log.warning("accept failed: %s", exc)
                if self.pending:
                    self._shed(list(self.pending.values()))
                return
            sock.setblocking(False)
            p = Pending(sock, peer, time.monotonic())
            mine = self.by_source.setdefault(p.source, [])
            if len(mine) >= self.max_per_source:
                self._shed(mine)
            if len(self.pending) >= self.max_all:
                self._shed(list(self.pending.values()))
            self.pending[sock.fileno()] = p
            self.by_source.setdefault(p.source, []).append(p)
            self.selector.register(sock, selectors.EVENT_READ)

    def _shed(self, among: list[Pending]) -> None:
        victim = min(among, key=lambda q: (q.stage, q.started))
        log.debug("shed the connection from %s (stage %d, %.3f s old)", victim.peer, victim.stage,
                  time.monotonic() - victim.started)
        self.shed += 1
        self._drop(victim)

    def _forget(self, p: Pending) -> None:
        fd = p.sock.fileno()
        if self.pending.pop(fd, None) is None:
            return
        if not p.wake:
            self.selector.unregister(p.sock)
        mine = self.by_source.get(p.source, [])
        mine.remove(p)
        if not mine:
            self.by_source.pop(p.source, None)

    def _drop(self, p: Pending) -> None:
        self._forget(p)
        p.sock.close()

    def _admit(self, p: Pending, ready: list[Admitted], hello, resume_id: str | None = None) -> None:
        self._forget(p)
        p.sock.setblocking(True)     # the worker shares this file description: it reads blocking
        ready.append(Admitted(p.sock, p.peer, hello, p.started + self.timeout, resume_id))

    def _report(self, now: float) -> None:
        if self.shed and now - self._reported > 60:
            log.warning("%d connections dropped unauthenticated in the last %.0f s (over RGPU_MAX_UNAUTH or "
                        "RGPU_MAX_UNAUTH_PER_SOURCE): a flood of strangers on the port?", self.shed, now - self._reported)
            self.shed, self._reported = 0, now

    # ---- the handshake, a frame at a time -------------------------------------------

    def _step(self, p: Pending, ready: list[Admitted]) -> None:
        try:
            if self.tls_cert is not None or p.stage == 0 and not p.buf:
                if self._first_bytes(p, ready):
                    return
            data = self._read_frame(p)
            if data is None:
                return
            t = _Buffered(p.sock, data)
            if p.stage == 0:
                p.hello, p.sn = handshake.server_hello(t, self.token, self.limits, self.versions)
                p.stage, p.buf = 1, bytearray()
                return
            hello = handshake.server_proof(t, self.token, self.limits, self.routes, p.hello, p.sn)
        except RgpuError as exc:
            if isinstance(exc, ProtocolError):
                handshake.refuse(_Buffered(p.sock, b""), "protocol", str(exc))
            say = log.warning if isinstance(exc, AuthenticationError) else log.debug
            say("handshake from %s refused: %s", p.peer, exc)
            self._drop(p)
            return
        self._admit(p, ready, hello)

    def _first_bytes(self, p: Pending, ready: list[Admitted]) -> bool:
        """Look at what the client sends first without taking it: True when that settled the connection
        (handed on for TLS, refused for a mismatch, gone) or it must wait; False: read the HELLO."""
        try:
            peeked = p.sock.recv(TLS_RECORD_MAX if self.tls_cert else 1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            self._drop(p)
            return True
        if not peeked:
            self._drop(p)
            return True
        is_tls = peeked[0] == tls.TLS_HANDSHAKE_RECORD or (   # (or a TLS session's resume, its start at least)
            self.tls_cert is not None and peeked[:4] == tls.RESUME_PREAMBLE[:len(peeked)])
        if (self.tls_cert is None) == is_tls:   # the wrong kind for this server: tls refuses it in rgpu framing
            try:
                tls.accept(p.sock, self.tls_cert)
            except RgpuError as exc:
                log.warning("connection from %s refused: %s", p.peer, exc)
            self._drop(p)
            return True
        if self.tls_cert is None:
            return False
        if peeked[:4] == tls.RESUME_PREAMBLE:   # a TLS session resumed: its worker does the TLS handshake
            rid, size = tls.parse_resume_preamble(peeked)
            if rid is not None:
                p.sock.recv(size)
                self._admit(p, ready, None, rid)
                return True
        elif len(peeked) >= 5 and len(peeked) >= 5 + int.from_bytes(peeked[3:5], "big"):
            self._admit(p, ready, None)
            return True
        # Incomplete: the bytes stay in the socket, so it stays readable; look again a little later
        if not p.wake:
            self.selector.unregister(p.sock)
        p.wake = time.monotonic() + PEEK_WAITS[min(p.peeks, len(PEEK_WAITS) - 1)]
        p.peeks += 1
        return True

    def _read_frame(self, p: Pending) -> bytes | None:
        """The frame's bytes once all have arrived (None until then); its header checked as soon as it is
        whole, so a frame too large for a handshake is refused without reading it."""
        while True:
            need = HEADER.size
            if len(p.buf) >= HEADER.size:
                try:
                    need += decode_header(p.buf, self.limits).meta_len
                except RgpuError:
                    return bytes(p.buf)     # the handshake decodes it again and refuses it with its reason
            if len(p.buf) >= need:
                return bytes(p.buf)
            try:
                chunk = p.sock.recv(need - len(p.buf))
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                raise ConnectionLost(f"reading before authentication: {exc}") from None
            if not chunk:
                raise ConnectionLost("the client closed the connection")
            p.buf += chunk
