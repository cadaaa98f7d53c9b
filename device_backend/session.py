"""The client's session with the server's ops route: started on first use of the device.

Owns the connection, the op index (each op's name and schema sent once, then
an integer), the allocator's event log that rides along with every message,
and the bulk transfers (``transfers.py``); with several servers, one of each
per server (``servers.py``), an op sent to its device's server. A leaf: ``startup`` builds the
session and installs it here (``startup.use`` swaps in another connection:
tests run the executor in-process); ``get()`` starts it through ``starter``.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from rgpu.config import settings as _settings
from rgpu.errors import RgpuError
from rgpu.protocol.ops import Msg
from rgpu.transport import ticketed

from .servers import FAILURES, Server, Servers
from .transfers import Transfers

lock = threading.RLock()  # held while a session starts or is swapped
starter: "Callable[[], object] | None" = None  # startup.start, set by register()
_session: "Session | None" = None


class Session:
    """``conns``: one connection, or one per server (``servers.py``) with ``wheres``, their addresses."""

    def __init__(self, conns, C, wheres: "list[str] | None" = None):
        conns = conns if isinstance(conns, list) else [conns]
        self.conn, self.C = conns[0], C    # server 0's (each server's: self.servers)
        self.lock = threading.RLock()  # ops come from the main thread and autograd's device threads
        self.servers = Servers(conns, C, self.lock, wheres or ["the server"] * len(conns))
        self.several = len(conns) > 1
        # RGPU_PEER_COPY, read when a session starts: copies between servers by the servers, or through here
        self.peer_through_client = self.several and _settings().peer_copy == "client"
        first = self.servers.all[0]
        self.ops = first.ops
        self.kind = first.kind
        self.names = [name for server in self.servers.all for name in server.names]
        self.count = self.servers.count
        self.server_torch = first.torch
        self.devtype = torch._C._get_privateuse1_backend_name()
        C.set_device_count(self.count, len(conns))
        for server in self.servers.all:
            server.transfers = Transfers(server)   # uploads and downloads of tensors' bytes
        self.transfers = first.transfers

    def _index(self, op, server=None) -> int:
        server = server or self.servers.all[0]
        idx = server.ops.get(op)
        if idx is None:
            idx = server.ops[op] = len(server.ops) + 1
            name = f"{op._schema.name[6:]}.{op._overloadname}"
            server.conn.post([Msg.DEFINE, idx, name, str(op._schema)])
        return idx

    def post_op(self, op, args, kwargs, outs, device: "int | None" = None) -> None:
        if self.several:
            server = self.servers.of_values(args, kwargs, device)
            with self.lock:
                self._on(server, lambda: server.conn.post(
                    [Msg.OP, server.events(), self._index(op, server), args, kwargs, outs]))
            return
        with self.lock:
            self.conn.post([Msg.OP, self.C.drain_events(), self._index(op), args, kwargs, outs])

    def call_op(self, op, args, kwargs, first_id: int, count: int, device: "int | None" = None):
        server = self.servers.of_values(args, kwargs, device) if self.several else self.servers.all[0]
        with self.lock:
            fut = self._on(server, lambda: server.conn.request(
                [Msg.CALL, server.events(), self._index(op, server), args, kwargs, first_id, count]))
        reply = self._on(server, fut.result)
        reply.release()
        return reply.meta[0]

    def server(self, device: "int | None") -> Server:
        """The server of ``rgpu:device`` (None: the current device's)."""
        return self.servers.of(device)

    def post(self, meta: list, device: "int | None" = None) -> None:
        """``meta`` to the server of ``device`` (server 0's when None: graphs, profiles)."""
        server = self.servers.of(device) if device is not None else self.servers.all[0]
        with self.lock:
            self._on(server, lambda: server.conn.post(meta))

    def request(self, meta: list, device: "int | None" = None):
        server = self.servers.of(device) if device is not None else self.servers.all[0]
        return self._on(server, lambda: server.request(meta))

    def sync(self, device: "int | None" = None) -> None:
        """Wait until the server of ``device`` (every server, when None) has run every op sent so far."""
        self.flush_events()
        waits = []
        with self.lock:  # every server asked first, then each answer waited for: one round trip in all
            for server in self.servers.all if device is None else [self.servers.of(device)]:
                waits.append((server, self._on(server, lambda: server.conn.request([Msg.SYNC]))))
        for server, fut in waits:
            self._on(server, fut.result).release()

    def peer_copy(self, src_desc, dst_desc) -> None:
        """``src``'s bytes into ``dst`` (the same shape and dtype, on two servers), server to server.

        Two posts, in stream order on both servers: the destination takes the transfer
        that presents the ticket, the source pushes it there (``server/ops/peer.py``).
        """
        src, dst = self.servers.of(src_desc[6]), self.servers.of(dst_desc[6])
        if dst.peer_port is None:
            raise RuntimeError(f"server {dst.where} opened no peer port: it cannot take a copy from another server")
        ticket = ticketed.new_ticket()   # never read as a TLS hello by a plain port
        pin = ((dst.conn.welcome or {}).get("info") or {}).get("peer_tls")   # its TLS certificate, when it serves TLS
        with self.lock:
            self._on(dst, lambda: dst.conn.post([Msg.PEER_RECV, dst.events(), dst_desc, ticket]))
            self._on(src, lambda: src.conn.post([Msg.PEER_SEND, src.events(), src_desc, ticket, dst.host,
                                                 dst.peer_port, pin]))

    def _on(self, server, call):
        """``call()``; a server gone is the session's end, named (the other servers are released)."""
        if not self.several:
            return call()
        if self.servers.failed is not None:
            raise self.servers.failed
        try:
            return call()
        except FAILURES as exc:
            raise self.servers.lost(server, exc) from None

    def flush_events(self) -> None:
        with self.lock:
            for server in self.servers.all:
                events = server.events()
                if events:
                    self._on(server, lambda: server.conn.post([Msg.EVENTS, events]))

    def close(self) -> None:
        try:
            if self.servers.failed is None:
                self.flush_events()
        except Exception:  # the server may already be gone at exit
            pass
        self.servers.close()


def current() -> Session | None:
    return _session


def get() -> Session:
    """The session, started on first use (by ``starter``: ``startup.start``, which ``register()`` sets)."""
    s = _session
    if s is not None:
        return s
    with lock:
        if _session is None:
            if starter is None:
                raise RgpuError("the rgpu device is not registered: call rgpu.register() (import rgpu does)")
            starter()
        return _session


def install(s: Session) -> Session | None:
    """Make ``s`` the session (``startup.use``); the previous one, if any, is returned for closing."""
    global _session
    old, _session = _session, s
    return old


def close_current() -> None:
    """At exit: the session's last events go, its connection closes."""
    if _session is not None:
        _session.close()


def stats(reset: bool = False) -> dict:
    """transport, messages, round_trips, bytes_out, bytes_in since import (or the last reset)."""
    s = _session
    counts = {"messages": 0, "round_trips": 0, "bytes_out": 0, "bytes_in": 0}
    if s is not None:
        if not s.several:
            counts = dict(s.conn.stats)
        else:  # every server's connection, summed
            for server in s.servers.all:
                for k, v in server.conn.stats.items():
                    counts[k] = counts.get(k, 0) + v
    base = _baseline.get(id(s), {})
    out = {"transport": s.conn.transport_name if s is not None else None}
    out.update({k: v - base.get(k, 0) for k, v in counts.items()})
    if reset:
        _baseline.clear()
        _baseline[id(s)] = counts
    return out


_baseline: dict = {}
