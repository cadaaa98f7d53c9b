"""Copies between two servers' devices, server to server: the bytes never pass through the client.

A client with several servers copies ``rgpu:i -> rgpu:j`` across them as two
posts, one to each session, both in stream order with the ops around them:

- ``PEER_RECV [events, dst, ticket]`` to the destination's session: when its
  turn comes, its worker takes the transfer that presents ``ticket`` on this
  session's peer port and writes the bytes into ``dst``;
- ``PEER_SEND [events, src, ticket, host, port, fingerprint]`` to the source's session: when
  its turn comes, its worker connects to ``host:port`` (the destination's peer
  port) and sends ``ticket``; once the destination says ``+`` (its copy's turn came), ``src``'s bytes
  (kind ``B``: the count, the bytes), or for a GPU tensor first its CUDA IPC handles (kind ``I``): two
  servers on one host copy GPU to GPU, and a destination that cannot open them answers ``B`` and takes
  the bytes instead. A refusal is ``-``, a length (2 bytes) and why, in words; the source raises it.

Why a ticket: the port (``transport/ticketed.py``) is a tcp port of the server's bind host; the ticket is
32 random bytes the client made for this one transfer and told both sessions over their authenticated
connections, so a stranger's connection (no ticket, another, one already used) never writes into this
session. A ticket that is not this copy's may be a later copy's whose source came first: it is held, unread,
until its copy claims it, and refused when none has within ``RGPU_PEER_TIMEOUT``, when more than
``MAX_EARLY`` wait, or with the session.

TLS: a server that serves ``--tls`` takes only TLS on its peer port (a plain connection is refused, named);
its session's WELCOME says its certificate's fingerprint (``peer_tls``), the client passes it along with the
ticket (``fingerprint``) and the source pins it, so the ticket and the bytes cross only to that server.
The port opens only for a client that asks (hello option ``peer``).
"""
from __future__ import annotations

import hmac
import logging
import socket
import ssl
import struct
import time

import msgpack
import torch

from rgpu.errors import ConfigError, RgpuError
from rgpu.transport import ticketed, tls

log = logging.getLogger("rgpu.server.peer")
TICKET_BYTES = ticketed.TICKET_BYTES
_HEAD = struct.Struct("!Q")          # after a kind: the byte count that follows
_WHY = struct.Struct("!H")           # after a refusal: the length of its reason
MAX_EARLY = 16                       # transfers arrived ahead of their PEER_RECV, kept by ticket
CHUNK = 4 << 20
MAX_SHARE = 4096                     # a CUDA IPC record's bytes (handles and geometry: a few hundred)
_BYTES, _IPC, _DONE = b"B", b"I", b"\x01"   # a transfer's kind (bytes follow / CUDA IPC handles), its end
_TAKEN, _REFUSED = b"+", b"-"               # the destination's word on a ticket
PLAIN_REFUSED = ("this server's peer port takes TLS only (it serves --tls): the source server connects with TLS "
                 "when the client passes the destination's certificate fingerprint along with the ticket (a client "
                 "and servers of one rgpu version do)")


class PeerError(Exception):
    """A peer transfer that could not be made (named by the executor as the failed op ``peer copy``)."""


class Peers:
    """One session's peer port (destination side) and its pushes (source side).

    ``tls_cert`` ({"cert", "key"}): the server serves TLS, and so does this port.
    """

    def __init__(self, host: str, timeout: float, tls_cert: dict | None = None):
        self.timeout = timeout
        self.listener = ticketed.Listener(host, backlog=MAX_EARLY, tls_cert=tls_cert, refuse=_refuse_kind)
        self.port = self.listener.port
        self.fingerprint = tls.file_fingerprint(tls_cert["cert"]) if tls_cert else None
        self.early: dict[bytes, tuple[socket.socket, float, object]] = {}   # ticket -> (connection, since, from)
        self.ipc = self.tcp = 0                        # transfers sent each way (GPU to GPU by CUDA IPC, tcp)
        self._client_tls: ssl.SSLContext | None = None

    @classmethod
    def of_server(cls, settings) -> "Peers":
        """The port for a session of a server with these settings (TLS when it serves ``--tls``)."""
        cert = tls.ServerCertificate.prepare(settings) if settings.tls else None
        return cls(settings.host, settings.peer_timeout, {"cert": cert.cert, "key": cert.key} if cert else None)

    def close(self) -> None:
        for conn, _, peer in self.early.values():
            _refuse(conn, peer, "the session ended before a copy of it claimed this ticket")
        self.early.clear()
        self.listener.close()

    # ---- destination --------------------------------------------------------------------

    def receive(self, ticket: bytes, dst: torch.Tensor) -> None:
        """Wait (up to the timeout) for the transfer presenting ``ticket``; its values into ``dst``."""
        held = self.early.pop(ticket, None)
        conn = held[0] if held is not None else self._accept(ticket)
        self.listener.spend(ticket)
        try:
            conn.settimeout(self.timeout)
            conn.sendall(_TAKEN)
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
        deadline = time.monotonic() + self.timeout
        while True:
            self._expire()
            try:
                got = self.listener.accept(deadline)
            except OSError as exc:   # the port itself (no descriptor left): waiting on would spin
                raise PeerError(f"this server's peer port cannot accept a transfer: {exc}") from None
            except RgpuError as exc:   # the wrong kind (refused, named), a failed TLS handshake, gone
                log.warning("peer port %d: %s", self.port, exc)
                continue
            if got is None:
                raise PeerError(f"no transfer from the source server within {self.timeout:g} s "
                                "(RGPU_PEER_TIMEOUT): is it still up, and can it reach this server?")
            conn, peer = got
            try:
                theirs = _read(conn, TICKET_BYTES)
            except (OSError, PeerError):
                conn.close()
                continue
            if ticketed.same(theirs, ticket):
                return conn
            self._hold(conn, theirs, peer)

    def _hold(self, conn: socket.socket, theirs: bytes, peer) -> None:
        """Another ticket: kept for its PEER_RECV (a later copy's source came first), its bytes unread, or
        refused, named."""
        if self.listener.is_spent(theirs):
            why = "this ticket was used already (a replayed transfer)"
        elif theirs in self.early:
            why = "another connection presented this ticket first"
        elif len(self.early) >= MAX_EARLY:
            why = f"{MAX_EARLY} transfers already wait for their copy's turn here"
        else:
            self.early[theirs] = (conn, time.monotonic(), peer)
            return
        _refuse(conn, peer, why)

    def _expire(self) -> None:
        now = time.monotonic()
        for ticket, (conn, since, peer) in list(self.early.items()):
            if now - since > self.timeout:
                del self.early[ticket]
                _refuse(conn, peer, f"no copy of this session claimed this ticket within {self.timeout:g} s "
                        "(RGPU_PEER_TIMEOUT)")

    # ---- source -------------------------------------------------------------------------

    def send(self, ticket: bytes, host: str, port: int, src: torch.Tensor, fingerprint: str | None = None) -> None:
        """Push ``src``'s values to the peer port at ``host:port`` under ``ticket``; returns once it has them.

        ``fingerprint``: the destination serves TLS, and its certificate must be this one (pinned).
        A GPU tensor is offered by CUDA IPC first (two servers on one host: the destination copies it
        GPU to GPU); where the destination cannot open it, or anywhere else, the bytes go over tcp.
        """
        where = f"{host}:{port}"
        try:
            conn = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as exc:
            raise PeerError(f"cannot reach the destination server's peer port {where}: {exc}") from None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if fingerprint is not None:
                conn = self._secure(conn, where, fingerprint)
            conn.sendall(ticket)
            if _word(conn, where) != _TAKEN:
                raise PeerError(f"the destination {where} answered the ticket with something else")
            share = _share(src)
            if share is not None:
                conn.sendall(_IPC + _HEAD.pack(len(share)) + share)
                answer = _word(conn, where)
                if answer == _DONE:
                    self.ipc += 1
                    return
                if answer != _BYTES:
                    raise PeerError(f"the destination {where} dropped the transfer")
            data = as_bytes(src)
            conn.sendall(_BYTES + _HEAD.pack(data.nbytes))
            conn.sendall(data)
            if _word(conn, where) != _DONE:
                raise PeerError(f"the destination {where} dropped the transfer")
            self.tcp += 1
        except OSError as exc:
            raise PeerError(f"cannot send to the destination server's peer port {where}: {exc}") from None
        finally:
            conn.close()

    def _secure(self, conn: socket.socket, where: str, fingerprint: str) -> ssl.SSLSocket:
        """TLS to the destination's peer port, its certificate pinned by ``fingerprint``."""
        try:
            pin = tls.normalize_fingerprint(fingerprint)
        except ConfigError:
            raise PeerError(f"the client passed no usable certificate fingerprint for {where}: "
                            f"{fingerprint!r}") from None
        if self._client_tls is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE   # the pin names the one certificate taken
            self._client_tls = ctx
        try:
            conn = self._client_tls.wrap_socket(conn)
        except ssl.SSLError as exc:
            if exc.reason in tls.NOT_TLS_REASONS:
                raise PeerError(f"the destination server's peer port {where} does not speak TLS, though its "
                                f"session gave a certificate fingerprint [{exc.reason}]") from None
            raise PeerError(f"TLS handshake with the destination's peer port {where} failed: "
                            f"{exc.reason or exc}") from None
        got = tls.fingerprint(conn.getpeercert(binary_form=True) or b"")
        if not hmac.compare_digest(got.replace(":", "").lower(), pin):
            conn.close()
            raise PeerError(f"the peer port {where} presented a TLS certificate of fingerprint {got}, not the "
                            "destination session's: someone may be in between; nothing was sent")
        return conn


def _refuse(conn: socket.socket, peer, why: str) -> None:
    """A connection's refusal in words (it reads them, if it still listens), then closed."""
    log.warning("peer connection from %s refused: %s", peer, why)
    try:
        _tell_refused(conn, why)
    finally:
        conn.close()


def _refuse_kind(conn: socket.socket, speaks_tls: bool) -> None:
    """A connection of the wrong kind: a plain one to a TLS port (told why), a TLS one to a plain port."""
    _tell_refused(conn, PLAIN_REFUSED if not speaks_tls else "this server's peer port is plain (it serves without --tls)")


def _tell_refused(conn: socket.socket, why: str) -> None:
    """The refusal and its reason, then our side shut and what the stranger sent drained (no reset eats the words)."""
    text = why.encode()[:1024]
    try:
        conn.sendall(_REFUSED + _WHY.pack(len(text)) + text)
        conn.shutdown(socket.SHUT_WR)
        _drain(conn)
    except OSError:
        pass


def _drain(conn: socket.socket) -> None:
    """What it sent already, read and dropped: closing on bytes unread would reset the connection, and its
    reader might lose the refusal."""
    conn.setblocking(False)
    try:
        conn.recv(1 << 16)
    except OSError:   # nothing there (TLS: nothing whole)
        pass


def _word(conn: socket.socket, where: str) -> bytes:
    """The destination's next word (one byte); a refusal raised with its reason."""
    got = conn.recv(1)
    if not got:
        raise PeerError(f"the destination {where} closed the transfer")
    if got == _REFUSED:
        (n,) = _WHY.unpack(_read(conn, _WHY.size))
        raise PeerError(f"the destination {where} refused the transfer: "
                        f"{_read(conn, n).decode('utf-8', 'replace')}")
    return got


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
