"""Setting up shm: the server's offer (a memfd, eventfds, a one-use Unix socket) and the client's attach.

The server makes the control segment (sealed memfd, nonce written at ``NONCE_OFF``),
four eventfds and an abstract Unix socket with a random name, and sends the name
and a random ticket over the authenticated tcp connection. The client connects,
sends the ticket, receives the descriptors (SCM_RIGHTS), maps the segment and
reads the nonce back: proof that both ends map the same memory, so the same
host. Nothing is named on disk; a client on another host (or in another network
namespace) cannot reach the socket at all.
"""
from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct

from rgpu.errors import AuthenticationError, ConnectError, ProtocolError

from .shm import ShmTransport, available
from .shm_memory import Segment
from .shm_ring import CONTROL_BYTES, CTL_HEAD, CTL_MAGIC, CTL_VERSION, NONCE_BYTES, NONCE_OFF, RING_BYTES, SLOTS, recv_fds

HELLO = struct.Struct("<Q")                # control segment size, sent with the descriptors


class ShmOffer:
    """The server's half of an upgrade: control segment, eventfds, and a one-use Unix socket."""

    def __init__(self):
        why = available()
        if why:
            raise ConnectError(why)
        self.nonce = os.urandom(NONCE_BYTES)
        self.ticket = os.urandom(32)
        self.efds: list[int] = []
        self.conn: socket.socket | None = None
        self.listener: socket.socket | None = None   # the one-use Unix socket, until the client connects
        self.control = Segment.create(0, CONTROL_BYTES, "rgpu-shm-control")
        try:
            CTL_HEAD.pack_into(self.control.mm, 0, CTL_MAGIC, CTL_VERSION, RING_BYTES, SLOTS)
            self.control.mm[NONCE_OFF:NONCE_OFF + NONCE_BYTES] = self.nonce
            self.efds = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(4)]
            self.address = "\0rgpu-shm-" + secrets.token_hex(16)   # abstract: nothing on disk to clean up
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self.listener.bind(self.address)
            self.listener.listen(1)
        except BaseException:
            self.cancel()
            raise

    def details(self) -> dict:
        return {"socket": self.address.encode(), "ticket": self.ticket}

    def accept(self, timeout: float) -> None:
        """Take the client's Unix connection, check its ticket, send it the descriptors."""
        self.listener.settimeout(timeout)
        conn, _ = self.listener.accept()
        self.listener.close()
        conn.settimeout(timeout)
        if not hmac.compare_digest(conn.recv(64), self.ticket):
            conn.close()
            raise AuthenticationError("shm: a Unix connection came without the ticket")
        socket.send_fds(conn, [HELLO.pack(CONTROL_BYTES)], [self.control.fd, *self.efds])
        conn.settimeout(None)
        self.conn = conn

    def proven(self, proof) -> bool:
        return isinstance(proof, bytes) and hmac.compare_digest(proof, self.nonce)

    def transport(self, use_c: bool = True, spin_us: float | None = None) -> ShmTransport:
        self.control.close_fd()
        t = ShmTransport("server", self.conn, self.control, self.efds, use_c=use_c, spin_us=spin_us)
        self.conn = None
        return t

    def cancel(self) -> None:
        for fd in self.efds:
            os.close(fd)
        self.efds = []
        if self.listener is not None:
            self.listener.close()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.control.close()


def attach(details: dict, timeout: float, use_c: bool = True,
           spin_us: float | None = None) -> tuple[ShmTransport, bytes]:
    """The client's half: connect to the server's Unix socket, map what it sends, read the nonce.

    Raises ConnectError when the socket is not reachable from here (another host,
    or another network namespace) or what arrives is not the server's segment.
    """
    why = available()
    if why:
        raise ConnectError(why)
    address, ticket = details.get("socket"), details.get("ticket")
    if not isinstance(address, bytes) or not address.startswith(b"\0rgpu-shm-") or not isinstance(ticket, bytes):
        raise ProtocolError("shm: the server's offer has no socket address or ticket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    fds: list[int] = []
    done = False
    try:
        try:
            sock.connect(address.decode())
        except OSError as exc:
            raise ConnectError(f"the server's shm socket is not reachable from here (another host or "
                               f"network namespace): {exc}") from None
        sock.sendall(ticket)
        msg, fds = recv_fds(sock, HELLO.size, 5)
        if len(msg) != HELLO.size or len(fds) != 5:
            raise ConnectError("shm: the server did not send its segment and eventfds")
        control = Segment.attach(0, fds.pop(0), HELLO.unpack(msg)[0], CONTROL_BYTES)
        magic, version, ring, slots = CTL_HEAD.unpack_from(control.mm, 0)
        if (magic, version, ring, slots) != (CTL_MAGIC, CTL_VERSION, RING_BYTES, SLOTS):
            control.close()
            raise ConnectError(f"shm: the server's layout ({magic!r} v{version}) is not this client's")
        nonce = bytes(control.mm[NONCE_OFF:NONCE_OFF + NONCE_BYTES])
        sock.settimeout(None)
        t = ShmTransport("client", sock, control, fds, use_c=use_c, spin_us=spin_us)
        done = True
        return t, nonce
    except (OSError, ProtocolError) as exc:
        raise ConnectError(f"shm: setting up failed: {exc}") from None
    finally:
        if not done:
            for fd in fds:
                os.close(fd)
            sock.close()
