"""``connect(route)``: a ready, authenticated connection to the server the settings name."""
from __future__ import annotations

import sys
import time
import uuid

from rgpu import config, excepthook, local_server
from rgpu.errors import ConnectionLost, Timeout

from . import handshake, negotiate, resume, tcp, tcp_streams_setup, tls, tokens
from .connection import Connection
from .resume import ResumingTransport
from .tcp import TcpTransport
from .wire import Limits


def resolve(settings) -> tuple[str, int, bytes]:
    """(host, port, token): ``RGPU_SERVER`` and the token, or the shared local server."""
    address = settings.server_address()
    if address is None:
        local = local_server.shared(settings)
        return local.host, local.port, local.token.encode()
    return address[0], address[1], tokens.read_token(settings)


def connect(route: str, *, settings=None, server: str | None = None, token: str | None = None,
            session: str | None = None, options: dict | None = None) -> Connection:
    """Connect, authenticate and open a session on ``route`` ("ops", "cuda", "echo")."""
    excepthook.install()   # an error that ends the program: one clear last line, without rgpu's frames
    s = settings or config.settings()
    if server is not None or token is not None:
        s = s.with_(**{k: v for k, v in (("server", server), ("token", token)) if v is not None})
    host, port, secret = resolve(s)
    use_tls = tls.wanted(s) and s.server_address() is not None  # the embedded local server is loopback, never TLS
    offer = negotiate.client_offer(s, tls=use_tls)
    sock = tcp.connect(host, port, s.connect_timeout)
    if use_tls:
        sock = tls.wrap_client(sock, s, host, port)
    transport = TcpTransport(sock)
    limits = Limits.from_settings(s)
    # resumable: this client can resume a dropped session, so the server may hold it (its grace); replay_bytes:
    # how often the server then acknowledges a stretch of posts (resume.py)
    hello = handshake.Hello(route=route, session=session or uuid.uuid4().hex, versions=handshake.software_versions(),
                            transports=offer, options={**(options or {}), "replay_bytes": s.replay_bytes,
                                                     "resumable": True, "streams": tcp_streams_setup.wanted(s)})
    where, phase = f"{host}:{port}", "handshake"
    waiting = _Waiting(where, sock)
    try:
        welcome = handshake.client_handshake(transport, secret, hello, limits, waiting)
        waiting.done()
        phase = "transport upgrade"
        transport = negotiate.client_upgrade(transport, welcome, s)  # shm / ucx when both ends can
        if transport.capabilities.resumable:   # still on tcp: the extra streams the server offers (RGPU_TCP_STREAMS)
            phase = "tcp streams' attaching"
            transport = tcp_streams_setup.client_attach(transport, welcome, host, secret, hello, s, use_tls)
    except Timeout:
        transport.close()
        what = "rgpu handshake" if phase == "handshake" else "answer to the transport upgrade"
        raise Timeout(f"no {what} from {where} within {s.connect_timeout:g} s: is it an rgpu server? "
                      "(RGPU_CONNECT_TIMEOUT waits longer)") from None
    except ConnectionLost as exc:
        transport.close()
        raise ConnectionLost(f"{where} closed the connection during the {phase} ({exc}): is it an rgpu server "
                             "of this version? its log says why") from None
    except BaseException:
        transport.close()
        raise
    transport.tune_reads(s.tcp_spin_us, s.shm_c)   # tcp polls before a read sleeps; shm and ucx wait their way
    if transport.capabilities.resumable:   # still on tcp (no upgrade)
        sock.settimeout(None)
        offer = welcome.get("resume")
        if isinstance(offer, dict):   # the server keeps the session through a drop (its grace)
            dead_s = resume.dead_after(resume.grace_of(offer, s))
            transport.give_up_after(dead_s)
            transport = ResumingTransport(transport, offer,
                                          _dialer(host, port, secret, hello, limits, s, use_tls, dead_s), s, where)
    if s.sim_rtt_ms > 0:  # RGPU_SIM_RTT_MS: a delay line for tests and benchmarks, after the handshake
        from .delay import DelayTransport

        transport = DelayTransport(transport, s.sim_rtt_ms / 1000.0)
    return Connection(transport, s, welcome, limits)


def _dialer(host: str, port: int, secret: bytes, hello: handshake.Hello, limits: Limits, s, use_tls: bool = False,
            dead_s: float = tcp.DEAD_AFTER_S):
    """How a resuming transport reconnects: ``dial(options, timeout)`` -> (tcp transport, WELCOME), the
    session's HELLO again (a new nonce, the token proved again) with ``options`` saying what to resume;
    over TLS after a plain preamble that routes the connection to the session's worker (tls.py). Each
    connection gives a silent link up after ``dead_s`` (``resume.dead_after``)."""

    def dial(options: dict, timeout: float):
        sock = tcp.connect(host, port, timeout)
        tcp.tune(sock, dead_s)   # (a resumed session is one stream)
        if use_tls:
            sock = tls.client_resume(sock, options["resume"], s, host, port)
        t = TcpTransport(sock)
        again = handshake.Hello(route=hello.route, session=hello.session, versions=hello.versions, transports=[],
                                options={**hello.options, **options})
        try:
            welcome = handshake.client_handshake(t, secret, again, limits, _Waiting(f"{host}:{port}", sock))
        except BaseException:
            t.close()
            raise
        sock.settimeout(None)
        t.tune_reads(s.tcp_spin_us, s.shm_c)
        return t, welcome

    return dial


class _Waiting:
    """The handshake's ``on_wait``: one line on stderr once the server has said twice that it is warming up
    (a wait of a moment goes unsaid), one when it is ready. Each WAIT re-arms the socket's timeout, at least three of the server's intervals between
    them: a warm-up of any length is waited for, a server that stops saying so is not."""

    def __init__(self, where: str, sock):
        self.where, self.sock, self.since, self.waits = where, sock, None, 0

    def __call__(self, meta: dict) -> None:
        every = meta.get("every_s")
        if isinstance(every, (int, float)) and every > 0:
            self.sock.settimeout(max(self.sock.gettimeout() or 0.0, 3.0 * every))
        self.waits += 1
        if self.since is None and self.waits >= 2:   # (a wait of a moment, a warm cache's, goes unsaid)
            self.since = time.monotonic() - float(meta.get("waited_s") or 0)
            print(f"rgpu: the server at {self.where} is warming up ({meta.get('message', 'starting a worker')}); "
                  "waiting for it", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.since is not None:
            print(f"rgpu: the server at {self.where} is ready (waited {time.monotonic() - self.since:.1f} s)",
                  file=sys.stderr, flush=True)
