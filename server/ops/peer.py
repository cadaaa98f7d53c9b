"""Copies between two servers' devices, server to server: the bytes never pass through the client.

A client with several servers copies ``rgpu:i -> rgpu:j`` across them as two
posts, one to each session, both in stream order with the ops around them:

- ``PEER_RECV [events, dst, ticket]`` to the destination's session: when its
  turn comes, its worker takes the transfer that presents ``ticket`` on this
  session's peer listener and writes the bytes into ``dst``;
- ``PEER_SEND [events, src, ticket, host, port]`` to the source's session: when
  its turn comes, its worker connects to ``host:port`` (the destination's peer
  listener) and sends ``ticket``, then ``src``'s bytes (kind ``B``: the count, the bytes), or
  for a GPU tensor first its CUDA IPC handles (kind ``I``): two servers on one host copy GPU to GPU, and
  a destination that cannot open them answers ``B`` and takes the bytes instead.

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

import msgpack
import torch

TICKET_BYTES = 32
_HEAD = struct.Struct("!Q")          # after the ticket: the byte count that follows
MAX_EARLY = 16                       # transfers arrived ahead of their PEER_RECV, kept by ticket
CHUNK = 4 << 20
MAX_SHARE = 4096                     # a CUDA IPC record's bytes (handles and geometry: a few hundred)
_BYTES, _IPC, _DONE = b"B", b"I", b"\x01"   # a transfer's kind (bytes follow / CUDA IPC handles), its end


class PeerError(Exception):
    """A peer transfer that could not be made (named by the executor as the failed op ``peer copy``)."""


class Peers:
    """One session's peer listener (destination side) and its pushes (source side)."""

    def __init__(self, host: str, timeout: float):
        self.timeout = timeout
        self.listener = socket.create_server((host, 0), backlog=MAX_EARLY)
        self.port = self.listener.getsockname()[1]
        self.early: dict[bytes, socket.socket] = {}   # ticket -> connection whose bytes are not read yet
        self.ipc = self.tcp = 0                        # transfers sent each way (GPU to GPU by CUDA IPC, tcp)

    def close(self) -> None:
        for conn in self.early.values():
            conn.close()
        self.early.clear()
        self.listener.close()

    # ---- destination --------------------------------------------------------------------

    def receive(self, ticket: bytes, dst: torch.Tensor) -> None:
        """Wait (up to the timeout) for the transfer presenting ``ticket``; its values into ``dst``."""
        conn = self.early.pop(ticket, None) or self._accept(ticket)
        try:
            mode = _read(conn, 1)
            if mode == _IPC:
                (n,) = _HEAD.unpack(_read(conn, _HEAD.size))
                if n > MAX_SHARE:
                    raise PeerError(f"the source's CUDA IPC record is {n} bytes (at most {MAX_SHARE})")
                share = msgpack.unpackb(_read(conn, n))
                if _copy_shared(share, dst):
                    conn.sendall(_DONE)
                    return
                conn.sendall(_BYTES)    # the source sends the bytes instead
                mode = _read(conn, 1)
            if mode != _BYTES:
                raise PeerError(f"the source sent an unknown transfer kind {mode!r}")
            staged = torch.empty(dst.shape, dtype=dst.dtype)
            into = memoryview(staged.reshape(-1).view(torch.uint8).numpy())
            (n,) = _HEAD.unpack(_read(conn, _HEAD.size))
            if n != into.nbytes:
                raise PeerError(f"the source sends {n} bytes, the destination holds {into.nbytes}")
            got = 0
            while got < n:
                k = conn.recv_into(into[got:], min(CHUNK, n - got))
                if k == 0:
                    raise PeerError(f"the source closed the transfer after {got} of {n} bytes")
                got += k
            dst.copy_(staged)
            conn.sendall(_DONE)   # the source's send ends when the bytes are in
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

    def send(self, ticket: bytes, host: str, port: int, src: torch.Tensor) -> None:
        """Push ``src``'s values to the peer listener at ``host:port`` under ``ticket``; returns once it has them.

        A GPU tensor is offered by CUDA IPC first (two servers on one host: the destination copies it
        GPU to GPU); where the destination cannot open it, or anywhere else, the bytes go over tcp.
        """
        try:
            with socket.create_connection((host, port), timeout=self.timeout) as conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(ticket)
                share = _share(src)
                if share is not None:
                    conn.sendall(_IPC + _HEAD.pack(len(share)) + share)
                    answer = conn.recv(1)
                    if answer == _DONE:
                        self.ipc += 1
                        return
                    if answer != _BYTES:
                        raise PeerError(f"the destination {host}:{port} dropped the transfer")
                data = as_bytes(src)
                conn.sendall(_BYTES + _HEAD.pack(data.nbytes))
                conn.sendall(data)
                if conn.recv(1) != _DONE:
                    raise PeerError(f"the destination {host}:{port} dropped the transfer")
                self.tcp += 1
        except OSError as exc:
            raise PeerError(f"cannot send to the destination server's peer port {host}:{port}: {exc}") from None


def as_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's values as contiguous bytes on the CPU (a GPU tensor is copied down first)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _share(src: torch.Tensor) -> bytes | None:
    """``src``'s CUDA IPC handles and geometry, packed; None on the CPU or where its memory cannot be shared."""
    if src.device.type != "cuda":
        return None
    try:
        handles = list(src.untyped_storage()._share_cuda_())   # records an event the destination waits on
    except Exception:
        return None
    return msgpack.packb([handles, list(src.shape), list(src.stride()), src.storage_offset()])


def _copy_shared(share, dst: torch.Tensor) -> bool:
    """The source's memory opened by CUDA IPC and copied into ``dst`` (then waited for, so that the source may
    let it go); False where it cannot be opened here (another host, a device this process cannot reach)."""
    if dst.device.type != "cuda":
        return False
    try:
        handles, size, stride, offset = share
        storage = torch.UntypedStorage._new_shared_cuda(*handles)
        src = torch.empty(0, dtype=dst.dtype, device=dst.device).set_(storage, offset, size, stride)
        dst.copy_(src)
        torch.cuda.current_stream(dst.device).synchronize()
        return True
    except Exception:
        return False


def _read(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise PeerError("the peer closed the connection")
        got += k
    return bytes(buf)
