"""Copies between two servers' devices, server to server: the bytes never pass through the client.

A client with several servers copies ``rgpu:i -> rgpu:j`` across them as two
posts, one to each session, both in stream order with the ops around them:

- ``PEER_RECV [events, dst, ticket]`` to the destination's session: when its
  turn comes, its worker takes the transfer that presents ``ticket`` on this
  session's peer listener and writes the bytes into ``dst``;
- ``PEER_SEND [events, src, ticket, host, port]`` to the source's session: when
  its turn comes, its worker connects to ``host:port`` (the destination's peer
  listener) and sends ``ticket``, the byte count, then ``src``'s bytes.

Why a ticket: the listener is a plain tcp port of the server's bind host; the
ticket is 32 random bytes the client made for this one transfer and told both
sessions over their authenticated connections, so a stranger's connection
(no ticket, or another) is dropped and cannot write into this session.
The listener opens only for a client that asks (hello option ``peer``).
"""
from __future__ import annotations

import hmac
import socket
import struct

import torch

TICKET_BYTES = 32
_HEAD = struct.Struct("!Q")          # after the ticket: the byte count that follows
MAX_EARLY = 16                       # transfers arrived ahead of their PEER_RECV, kept by ticket
CHUNK = 4 << 20


class PeerError(Exception):
    """A peer transfer that could not be made (named by the executor as the failed op ``peer copy``)."""


class Peers:
    """One session's peer listener (destination side) and its pushes (source side)."""

    def __init__(self, host: str, timeout: float):
        self.timeout = timeout
        self.listener = socket.create_server((host, 0), backlog=MAX_EARLY)
        self.port = self.listener.getsockname()[1]
        self.early: dict[bytes, socket.socket] = {}   # ticket -> connection whose bytes are not read yet

    def close(self) -> None:
        for conn in self.early.values():
            conn.close()
        self.early.clear()
        self.listener.close()

    # ---- destination --------------------------------------------------------------------

    def receive(self, ticket: bytes, into: memoryview) -> None:
        """Wait (up to the timeout) for the transfer presenting ``ticket``; its bytes into ``into``."""
        conn = self.early.pop(ticket, None) or self._accept(ticket)
        try:
            (n,) = _HEAD.unpack(_read(conn, _HEAD.size))
            if n != into.nbytes:
                raise PeerError(f"the source sends {n} bytes, the destination holds {into.nbytes}")
            got = 0
            while got < n:
                k = conn.recv_into(into[got:], min(CHUNK, n - got))
                if k == 0:
                    raise PeerError(f"the source closed the transfer after {got} of {n} bytes")
                got += k
            conn.sendall(b"\x01")   # the source's send ends when the bytes are in
        except OSError as exc:
            raise PeerError(f"the transfer from the source failed: {exc}") from None
        finally:
            conn.close()

    def _accept(self, ticket: bytes) -> socket.socket:
        self.listener.settimeout(self.timeout)
        while True:
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                raise PeerError(f"no transfer from the source server within {self.timeout:g} s "
                                "(RGPU_PEER_TIMEOUT): is it still up, and can it reach this server?") from None
            conn.settimeout(self.timeout)
            try:
                theirs = _read(conn, TICKET_BYTES)
            except (OSError, PeerError):
                conn.close()
                continue
            if hmac.compare_digest(theirs, ticket):
                return conn
            if len(self.early) < MAX_EARLY and theirs not in self.early:
                # a later transfer's source came first (several sources): kept for its PEER_RECV;
                # a stranger's bytes are never read, and its connection goes with the session
                self.early[theirs] = conn
            else:
                conn.close()

    # ---- source -------------------------------------------------------------------------

    def send(self, ticket: bytes, host: str, port: int, data: memoryview) -> None:
        """Push ``data`` to the peer listener at ``host:port`` under ``ticket``; returns once it has them."""
        try:
            with socket.create_connection((host, port), timeout=self.timeout) as conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(ticket + _HEAD.pack(data.nbytes))
                conn.sendall(data)
                if conn.recv(1) != b"\x01":
                    raise PeerError(f"the destination {host}:{port} dropped the transfer")
        except OSError as exc:
            raise PeerError(f"cannot send to the destination server's peer port {host}:{port}: {exc}") from None


def as_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's values as contiguous bytes on the CPU (a GPU tensor is copied down first)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _read(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise PeerError("the peer closed the connection")
        got += k
    return bytes(buf)
