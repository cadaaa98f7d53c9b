"""The tcp transport: always there, scatter/gather ``sendmsg`` out, ``recv_into`` in."""
from __future__ import annotations

import select
import socket
import ssl
from typing import Sequence

from rgpu.errors import ConfigError, ConnectionLost, translate_os_error

from .base import Capabilities, Into, StreamReader, Transport, spin_seconds
from .buffers import BufferPool
from .wire import Frame, Limits

_DONTWAIT = socket.MSG_DONTWAIT
IOV_MAX = 1024  # sendmsg's limit on parts per call on Linux
TLS_JOIN_BYTES = 64 << 10  # TLS: parts smaller than this are joined into one write


DEAD_AFTER_S = 60.0   # a peer that stops answering is given up on after about this long


def tune(sock: socket.socket, dead_after_s: float = DEAD_AFTER_S) -> None:
    """Low latency (no Nagle) and a dead peer noticed within about ``dead_after_s``: by keepalive while the link
    is quiet (probes from half of it, three of them), by TCP_USER_TIMEOUT while sent bytes go unacknowledged
    (keepalive sends no probe then; a write blocked on a peer that stopped reading fails then, too)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(dead_after_s / 2))
    for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3)), ("TCP_KEEPCNT", 3),
                       ("TCP_USER_TIMEOUT", max(1000, int(dead_after_s * 1000)))):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class TcpTransport(Transport):
    name = "tcp"
    # A client's small posts gather 200 µs before its own thread writes them (Connection): a post
    # handed to the I/O thread cost GIL hand-offs (docs/perf/fast_path-history.md), one written alone a syscall
    capabilities = Capabilities(batch_window_s=200e-6, resumable=True)

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._reader = StreamReader(sock.recv_into)
        self._closed = False
        self.spin_s = 0.0

    def spin_reads(self, spin_us: float | None, use_c: bool = True) -> None:
        """Before a read sleeps, poll the socket for ``spin_us`` (RGPU_TCP_SPIN_US; unset: 20 ms on a machine
        of 8 cores or more, else not at all), in C without the GIL (shm's C module): a reader asleep costs
        every write to it a wake-up of its thread, and a session's server waits for the next op again and
        again. Called once the handshake is over. Not with TLS (its records are read through the SSL object):
        there a frame's big buffers are read in C instead (``tls_fast.py``), where it builds and ``use_c``."""
        from . import shm_fast

        if self._tls:
            from . import tls_fast

            self._reader.read_exactly = tls_fast.exact_reader(self.sock, use_c)
            return
        spin_s = spin_seconds(spin_us, 0.0)
        module = shm_fast.load(use_c) if spin_s > 0 and not self._tls else None
        if module is None:
            return
        spin, fd, recv_into = module.lib.rgpu_fd_spin, self.sock.fileno(), self.sock.recv_into

        def recv_spinning(view) -> int:
            try:
                return recv_into(view, 0, _DONTWAIT)   # with a timeout set, Python waits for it first, as before
            except BlockingIOError:
                spin(fd, spin_s)
                return recv_into(view)

        self.spin_s = spin_s
        self._reader.recv_into = recv_spinning

    @property
    def tls(self) -> bool:
        return self._tls

    def give_up_after(self, seconds: float) -> None:
        """A silent peer is given up on after about ``seconds`` (``tune``), on each of this connection's sockets."""
        tune(self.sock, seconds)

    def send(self, parts: Sequence[memoryview]) -> None:
        try:
            if self._tls:
                self._send_tls(parts)
                return
            self._sendmsg_all(parts)
        except OSError as exc:
            raise translate_os_error(exc, where="sending") from None

    def _send_tls(self, parts: Sequence) -> None:
        # SSLSocket has no sendmsg and copies every byte into its records anyway; small parts are
        # joined first, since one SSL_write each means one record and one syscall each (posts: 2x)
        pending = bytearray()
        for p in parts:
            small = memoryview(p).nbytes < TLS_JOIN_BYTES
            if small:
                pending += p
            if pending and (not small or len(pending) >= TLS_JOIN_BYTES):
                self.sock.sendall(pending)
                pending = bytearray()
            if not small:
                self.sock.sendall(p)
        if pending:
            self.sock.sendall(pending)

    def _sendmsg_all(self, parts: Sequence) -> None:
        # with an on_block hook, never sleep inside sendmsg: a full socket hands control to the hook
        on_block = self.on_block
        flags = _DONTWAIT if on_block is not None else 0
        n = len(parts)
        if n <= IOV_MAX:
            # the common case (a frame or a batch of them, bytes and byte views, all taken at once): one call,
            # the parts as given; anything else (another buffer type, a partial write) is the loop below's
            total = 0
            for p in parts:
                t = type(p)
                if t is bytes:
                    total += len(p)
                elif t is memoryview and p.itemsize == 1 and p.ndim == 1 and p.c_contiguous:
                    total += p.nbytes
                else:
                    break
            else:
                try:
                    sent = self.sock.sendmsg(parts, (), flags)
                except BlockingIOError:
                    sent = 0
                if sent == total:
                    return
                parts = _after(parts, sent)
        pending, total = [], 0
        for p in parts:
            if type(p) is not bytes:
                p = memoryview(p).cast("B")
            if len(p):
                pending.append(p)
                total += len(p)
        i = 0
        while i < len(pending):
            try:
                sent = self.sock.sendmsg(pending if i == 0 and len(pending) <= IOV_MAX else pending[i:i + IOV_MAX],
                                         (), flags)
            except BlockingIOError:
                sent = 0
            total -= sent
            if not total:
                return  # the common case: everything went in one call
            while sent:  # drop what went out, keep the tail of a part sent in half
                head = pending[i]
                if sent >= len(head):  # bytes or a 1-D byte view: len is the byte count
                    sent -= len(head)
                    i += 1
                else:
                    pending[i] = head[sent:]
                    sent = 0
            if flags and i < len(pending):
                want = on_block()
                if want is None:
                    flags = 0  # nothing can arrive that the peer waits to write: plain blocking sends
                else:
                    self._wait_io(read=want)

    def _wait_io(self, read: bool) -> None:
        """Until the socket takes more bytes (or, with ``read``, has bytes to read)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT | (select.POLLIN if read else 0))
        poller.poll(1000 if read else 10)  # without read another thread reads: look again soon

    def readable(self, timeout: float) -> bool:
        """Whether a frame has started to arrive within ``timeout`` seconds."""
        if self._reader.staged or (self._tls and self.sock.pending()):
            return True
        if self.sock.fileno() < 0:   # closed (an abort on another thread): nothing will arrive
            raise ConnectionLost("the connection is closed")
        poller = select.poll()  # not select(): it fails for descriptors past FD_SETSIZE
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))

    def recv_frame(self, limits: Limits, pool: BufferPool, into: Into | None = None) -> Frame:
        try:
            return self._reader.read_frame(limits, pool, into)
        except EOFError:
            raise ConnectionLost("the peer closed the connection") from None
        except OSError as exc:
            if self._closed:
                raise ConnectionLost("connection closed") from None
            raise translate_os_error(exc, where="receiving") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def abort(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on this socket
        except OSError:
            pass
        self.close()


def _after(parts: Sequence, sent: int) -> list:
    """What is left of ``parts`` (bytes and 1-D byte views) once ``sent`` bytes of them went."""
    i = 0
    while sent:
        n = len(parts[i])
        if sent < n:
            return [parts[i][sent:], *parts[i + 1:]]
        sent -= n
        i += 1
    return list(parts[i:])


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A connected, tuned socket (blocking once connected)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise translate_os_error(exc, connecting=True, where=f"{host}:{port}") from None
    tune(sock)
    return sock


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                          "(another server there? choose another --port / RGPU_PORT)") from None
    return sock
