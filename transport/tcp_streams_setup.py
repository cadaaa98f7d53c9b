"""Attaching a tcp session's extra streams (``RGPU_TCP_STREAMS``), each authenticated as the main one is.

    client                                           server (the session's worker)
    HELLO {options: {streams: N}}                ->
                                                 <-  WELCOME {streams: {port, count, ticket, stripe_bytes}}
                                                     (a listener of the worker's own, on the address the
                                                     client reached; the offer lapses if it upgrades to shm/ucx)
    for i in 1..count-1, a new connection to that port ([TLS, the same certificate checks]):
      HELLO {route: "stream", session, options: {stream: i, ticket}}, the token's mutual HMAC (handshake.py),
                                                 <-  WELCOME {stream: i}   or REFUSED auth
    UPGRADE {transport: "tcp", streams: [i...]}  ->  (on the main connection: the ones that attached)
    both ends: StripedTcp(main, streams)         (tcp_streams.py)

A stream proves the token and names the session and its ticket (32 random bytes said only inside the
authenticated session), so a stranger cannot attach one to someone's session; the port is a ticketed
listener (``ticketed.py``: a stranger has a few seconds to say who it is, and the port closes once the
streams attached). A client that cannot
reach the port (an SSH tunnel forwards one port; a firewall) goes on with the streams it has, one
at least, and says so once. A resumed connection (``resume.py``) is one stream.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import time

from rgpu.errors import AuthenticationError, ConnectionLost, ProtocolError, RgpuError, translate_os_error

from . import handshake, tcp, ticketed, tls
from .tcp import TcpTransport
from .tcp_streams import StripedTcp
from .wire import BufferPool, Limits, MsgKind

log = logging.getLogger("rgpu.transport")
MAX_STREAMS = 16
AUTO_CORES, AUTO_STREAMS = 8, 4    # unset: 4 streams on a machine of 8 cores or more, else 1 (each stream's copy takes a core)
STRIPE_BYTES = 2 << 20             # a frame whose buffers hold this much or more is striped (the server says)
DIAL_TIMEOUT_S = 5.0               # at most this long for each extra stream's connection and handshake
ROUTE = "stream"
LIMITS = Limits(max_frame_bytes=1 << 20, max_meta_bytes=1 << 20, max_buffers=0)
_pool = BufferPool(keep_bytes=0)
_warned = False


def wanted(settings) -> int:
    """How many streams this end wants in all (the main one counted): RGPU_TCP_STREAMS, else by cores."""
    n = settings.tcp_streams
    if n is None:
        n = AUTO_STREAMS if (os.cpu_count() or 1) >= AUTO_CORES else 1
    return max(1, min(int(n), MAX_STREAMS))


def _send(t: TcpTransport, meta: dict) -> None:
    t.send(t.frame_parts(MsgKind.UPGRADE, 0, 0, meta, []))


# ---- the client ----------------------------------------------------------------------------------


def client_attach(t: TcpTransport, welcome: dict, host: str, token: bytes, hello: handshake.Hello, settings,
                  use_tls: bool) -> TcpTransport:
    """After WELCOME (and staying on tcp): the session's extra streams attached where the server offered them."""
    offer = welcome.get("streams")
    if offer is None:
        return t
    port, count, ticket, stripe = (offer.get(k) if isinstance(offer, dict) else None
                                   for k in ("port", "count", "ticket", "stripe_bytes"))
    if not (isinstance(port, int) and isinstance(count, int) and isinstance(ticket, bytes)
            and isinstance(stripe, int) and 1 < count <= MAX_STREAMS and stripe > 0):
        raise ProtocolError(f"handshake: WELCOME's streams offer is malformed: {offer!r}")
    socks, ip = [], t.sock.getpeername()[0]   # the address the main connection reached; TLS still checks `host`
    for i in range(1, count):
        try:
            socks.append(_dial(host, port, token, hello, settings, use_tls, i, ticket, ip))
        except RgpuError as exc:
            _warn_once(f"rgpu: tcp: extra stream {i} of {count} to {host}:{port} could not attach ({exc}); going on "
                       f"with {len(socks) + 1} (RGPU_TCP_STREAMS=1 skips the attempt)")
            break
    try:
        _send(t, {"transport": "tcp", "streams": list(range(1, len(socks) + 1))})
    except BaseException:
        for s in socks:
            s.close()
        raise
    return StripedTcp(t, socks, stripe) if socks else t


def _dial(host: str, port: int, token: bytes, hello: handshake.Hello, settings, use_tls: bool, index: int,
          ticket: bytes, ip: str | None = None) -> socket.socket:
    sock = tcp.connect(ip or host, port, min(settings.connect_timeout, DIAL_TIMEOUT_S))
    if use_tls:
        sock = tls.wrap_client(sock, settings, host, port)   # the same pin or CA as the main connection's
    st = TcpTransport(sock)
    mine = handshake.Hello(route=ROUTE, session=hello.session, versions=hello.versions, transports=[],
                           options={"stream": index, "ticket": ticket})
    try:
        got = handshake.client_handshake(st, token, mine, LIMITS)
        if got.get("info", {}).get("stream") != index:
            raise ProtocolError(f"tcp stream {index}: the server's WELCOME names another stream ({got.get('info')!r})")
    except BaseException:
        st.close()
        raise
    sock.settimeout(None)
    return sock


def _warn_once(text: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("%s", text)


# ---- the server ----------------------------------------------------------------------------------


class ServerOffer:
    """The worker's side: a listener for one session's extra streams, from WELCOME until they attach."""

    def __init__(self, main: socket.socket, session: str, count: int, token: bytes, tls_cert: dict | None,
                 timeout_s: float):
        self.session, self.count, self.token, self.tls_cert = session, count, token, tls_cert
        self.timeout_s = timeout_s
        self.ticket = ticketed.new_ticket()
        self.stripe_bytes = STRIPE_BYTES
        # the address the client reached, a port of our own
        self.listener = ticketed.Listener(main.getsockname()[0], backlog=count, tls_cert=tls_cert,
                                          refuse=_refuse_kind, family=main.family, stranger_s=DIAL_TIMEOUT_S)

    @classmethod
    def make(cls, main: socket.socket, hello: handshake.Hello, settings, token: bytes,
             tls_cert: dict | None) -> "ServerOffer | None":
        """An offer when the client asks for streams (its HELLO) and this end wants more than one, else None."""
        asked = hello.options.get("streams")
        count = min(asked, wanted(settings)) if isinstance(asked, int) and not isinstance(asked, bool) else 1
        if count < 2:
            return None
        try:
            return cls(main, hello.session, count, token, tls_cert, settings.connect_timeout + DIAL_TIMEOUT_S)
        except (OSError, RgpuError) as exc:
            log.warning("tcp streams: cannot listen for a session's extra streams (%s); it goes on one", exc)
            return None

    def details(self) -> dict:
        return {"port": self.listener.port, "count": self.count, "ticket": self.ticket,
                "stripe_bytes": self.stripe_bytes}

    def cancel(self) -> None:
        self.listener.close()

    def attach(self, t: TcpTransport) -> TcpTransport:
        """Take the client's streams as they come, until its word on ``t`` says which attached."""
        got: dict[int, socket.socket] = {}
        deadline = time.monotonic() + self.timeout_s
        try:
            while not t.readable(0):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionLost(f"the client neither attached its tcp streams nor said so in {self.timeout_s:g} s")
                poller = select.poll()
                poller.register(self.listener, select.POLLIN)
                poller.register(t.sock, select.POLLIN)
                if any(fd == self.listener.fileno() for fd, _ in poller.poll(left * 1000)):
                    self._admit(got, time.monotonic() + min(left, DIAL_TIMEOUT_S))
            frame = t.recv_frame(LIMITS, _pool)
        except BaseException:
            for s in got.values():
                s.close()
            raise
        finally:
            self.listener.close()
        said = frame.meta.get("streams") if frame.kind == MsgKind.UPGRADE and isinstance(frame.meta, dict) else None
        if not isinstance(said, list) or len(set(said)) != len(said) or not all(i in got for i in said):
            for s in got.values():
                s.close()
            raise ProtocolError(f"tcp streams: the client's word {frame.kind.name} {frame.meta!r} does not name the "
                                f"streams that attached here ({sorted(got)})")
        for i in set(got) - set(said):
            got[i].close()
        return StripedTcp(t, [got[i] for i in said], self.stripe_bytes) if said else t

    def _admit(self, got: dict, deadline: float) -> None:
        try:   # a stranger who stalls is dropped: it has until `deadline` to prove the token and the ticket
            accepted = self.listener.accept(deadline)
        except OSError as exc:
            raise translate_os_error(exc, where="accepting a tcp stream") from None
        except RgpuError as exc:
            log.warning("a tcp stream refused: %s", exc)
            return
        if accepted is None:
            return
        conn, peer = accepted
        try:
            st = TcpTransport(conn)
            hello, sn = handshake.server_hello(st, self.token, LIMITS)
            handshake.server_proof(st, self.token, LIMITS, {ROUTE}, hello, sn)
            index, ticket = hello.options.get("stream"), hello.options.get("ticket")
            if hello.session != self.session or not ticketed.same(ticket, self.ticket):
                handshake.refuse(st, "auth", "this stream names no session of this worker")
                raise AuthenticationError(f"a tcp stream from {peer} named another session")
            if not isinstance(index, int) or not 0 < index < self.count or index in got:
                handshake.refuse(st, "protocol", f"stream {index!r}: not one of 1..{self.count - 1} still to come")
                raise ProtocolError(f"a tcp stream from {peer} named stream {index!r}")
            handshake.welcome(st, self.session, [], {"stream": index})
            conn.settimeout(None)
            got[index] = conn
        except (RgpuError, OSError) as exc:
            log.warning("a tcp stream from %s refused: %s", peer, exc)
            conn.close()


def _refuse_kind(conn: socket.socket, speaks_tls: bool) -> None:
    """A stream of the wrong kind, answered in the main port's words (``tls.accept``): a plain REFUSED frame."""
    handshake.refuse(TcpTransport(conn), "tls", "this server does not use TLS (started without --tls)" if speaks_tls
                     else "this server requires TLS (started with --tls): set RGPU_TLS=1 and " + tls.PIN_HINT +
                     ", or set RGPU_TLS_CA; or reach it with `rgpu run --ssh`")
