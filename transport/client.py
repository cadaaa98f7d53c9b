"""``connect(route)``: a ready, authenticated connection to the server the settings name."""
from __future__ import annotations

import uuid

from rgpu import config

from . import handshake, local_server, negotiate, tcp, tls, tokens
from .connection import Connection
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
    hello = handshake.Hello(route=route, session=session or uuid.uuid4().hex, versions=handshake.software_versions(),
                            transports=offer, options=options or {})
    try:
        welcome = handshake.client_handshake(transport, secret, hello, limits)
        transport = negotiate.client_upgrade(transport, welcome, s)  # shm / ucx when both ends can
    except BaseException:
        transport.close()
        raise
    if transport.name == "tcp":
        sock.settimeout(None)
        transport.spin_reads(s.tcp_spin_us, s.shm_c)
    if s.sim_rtt_ms > 0:  # RGPU_SIM_RTT_MS: a delay line for tests and benchmarks, after the handshake
        from .delay import DelayTransport

        transport = DelayTransport(transport, s.sim_rtt_ms / 1000.0)
    return Connection(transport, s, welcome, limits)
