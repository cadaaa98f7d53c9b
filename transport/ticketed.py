"""A session's ticketed listener: a port of its own that lets in only a connection presenting a one-time ticket.

Two users, each with its own ticket and wording, the same rules:

    user                          ticket                                   presented
    tcp_streams_setup.ServerOffer the session's extra streams, one offer   inside the stream's HELLO, after the
                                  (WELCOME names it)                       token's mutual HMAC
    server/ops/peer.Peers         one copy between two servers' devices    the first 32 bytes, raw (inside TLS
                                  (the client told both sessions)          when the server serves --tls)

The ticket is 32 random bytes said only inside an authenticated session, compared in constant time
(``same``). A stranger (no ticket, another, a stall) has ``STRANGER_S`` to present one, so it never holds
the worker longer; a connection of the wrong kind (plain to a TLS server, TLS to a plain one) is answered by
the user's ``refuse`` and dropped before anything is read. The worker reaches the listener only inside its
own calls (``accept(deadline)``): no thread, no wait without a deadline. It closes once used (the streams'
offer) or with the session (the peer port); a copy's ticket, once used, is ``spent`` and refused again.
"""
from __future__ import annotations

import hmac
import os
import select
import socket
import ssl
import time
from collections import OrderedDict
from typing import Callable

from rgpu.errors import AuthenticationError, ConfigError, ConnectionLost, translate_os_error

from . import tcp, tls

TICKET_BYTES = 32
STRANGER_S = 5.0        # at most this long for an accepted connection to say who it is (TLS handshake included)
SPENT_KEPT = 4096       # tickets used, remembered to refuse a replay (the oldest forgotten first)


def new_ticket() -> bytes:
    """32 random bytes, never beginning with the TLS handshake record's byte: a plain port tells a plain
    connection from a TLS one by its first byte, which is the ticket's (1 in 256 random tickets was refused)."""
    while True:
        ticket = os.urandom(TICKET_BYTES)
        if ticket[0] != tls.TLS_HANDSHAKE_RECORD:
            return ticket


def same(theirs, ours: bytes) -> bool:
    """Whether ``theirs`` is the ticket ``ours``: bytes of its length, compared in constant time."""
    return isinstance(theirs, (bytes, bytearray)) and len(theirs) == len(ours) and hmac.compare_digest(theirs, ours)


class Listener:
    """One session's ticketed port on ``host`` (port 0: the kernel picks one).

    ``tls_cert`` ({"cert", "key"} paths, or None): TLS on every connection when given. ``refuse(conn,
    speaks_tls)`` answers a connection of the wrong kind in its user's words (it may send a line, never
    read); ``accept`` then raises ``ConfigError`` naming the mismatch.
    """

    def __init__(self, host: str, *, backlog: int, tls_cert: dict | None = None,
                 refuse: Callable[[socket.socket, bool], None] | None = None, family: int | None = None,
                 stranger_s: float | None = None):
        family = family if family is not None else (socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.context = tls.server_context(tls_cert["cert"], tls_cert["key"]) if tls_cert else None
        self.refuse, self.stranger_s = refuse, STRANGER_S if stranger_s is None else stranger_s
        self.sock = socket.create_server((host, 0), family=family, backlog=backlog)
        self.port = self.sock.getsockname()[1]
        self.spent: OrderedDict[bytes, None] = OrderedDict()

    @property
    def tls(self) -> bool:
        return self.context is not None

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def spend(self, ticket: bytes) -> None:
        """``ticket`` was used: a connection presenting it again is a replay."""
        self.spent[bytes(ticket)] = None
        while len(self.spent) > SPENT_KEPT:
            self.spent.popitem(last=False)

    def is_spent(self, ticket: bytes) -> bool:
        return bytes(ticket) in self.spent

    def waiting(self, timeout_s: float) -> bool:
        """Whether a connection waits to be accepted (waiting at most ``timeout_s``)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(max(0.0, timeout_s) * 1000))

    def accept(self, deadline: float) -> tuple[socket.socket, object] | None:
        """The next connection, tuned, TLS done where the listener serves TLS, with a short timeout set for its
        first words (``STRANGER_S``, or what is left to ``deadline``, a ``time.monotonic()``); None when none
        came by ``deadline``. That connection's failures are RgpuErrors, and close it: ConfigError (the wrong
        kind, answered by ``refuse``), AuthenticationError (its TLS handshake), ConnectionLost, Timeout (it
        stalled). The listener's own (no descriptor left) is the OSError, raised as it is."""
        if not self.waiting(deadline - time.monotonic()):
            return None
        conn, peer = self.sock.accept()
        try:
            conn.settimeout(min(self.stranger_s, max(0.1, deadline - time.monotonic())))
            tcp.tune(conn)
            return self._secure(conn, peer), peer
        except BaseException:
            conn.close()
            raise

    def _secure(self, conn: socket.socket, peer) -> socket.socket:
        try:
            first = conn.recv(1, socket.MSG_PEEK)
        except OSError as exc:
            raise translate_os_error(exc, where=f"waiting for the first bytes from {peer}") from None
        if not first:
            raise ConnectionLost(f"{peer} closed the connection before saying anything")
        speaks_tls = first[0] == tls.TLS_HANDSHAKE_RECORD
        if speaks_tls != self.tls:
            if self.refuse is not None:
                self.refuse(conn, speaks_tls)
            raise ConfigError(f"a {'TLS' if speaks_tls else 'plain'} connection from {peer} reached this "
                              f"{'TLS' if self.tls else 'plain'} port; refused")
        if self.context is None:
            return conn
        try:
            return self.context.wrap_socket(conn, server_side=True)
        except ssl.SSLError as exc:
            raise AuthenticationError(f"TLS handshake with {peer} failed: {exc.reason or exc}") from None
        except OSError as exc:
            raise translate_os_error(exc, where=f"TLS handshake with {peer}") from None
