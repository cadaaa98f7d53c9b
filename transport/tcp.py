"""The tcp transport: always there, scatter/gather ``sendmsg`` out, ``recv_into`` in (``StreamReader``: its frames)."""
from __future__ import annotations

import select
import socket
import ssl
from typing import Sequence

from rgpu.errors import ConfigError, ConnectionLost, translate_os_error

from . import wire
from .base import Capabilities, Into, Transport, spin_seconds
from .wire import (
    _KINDS, _LENGTH_STRUCTS, HEADER, KNOWN_FLAGS, MAGIC, BufferPool, Frame, Limits, decode_header, decode_lengths,
    unpack_meta,
)

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

    def tune_reads(self, spin_us: float | None, use_c: bool = True) -> None:
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


class StreamReader:
    """Frame decoding over a byte stream with a staging buffer.

    Small frames arrive in one ``recv_into`` of the staging buffer; large buffers
    are read straight into their destination once what is staged is used up.
    """

    STAGE = 256 << 10
    SMALL = 64 << 10   # buffers up to this size get their own bytearray: no pool lock, no lease to release
    # Read ahead at most this much: whatever arrives with a header is copied once more out of the
    # stage (whole-stage reads lagged a raw socket at 256 KiB: docs/perf/transport-history.md, tcp),
    # yet batches of small frames still come in a few calls.
    READ_AHEAD = 64 << 10

    def __init__(self, recv_into):
        self.recv_into = recv_into           # fills up to len(view) bytes, returns count (0 = EOF); replaceable
        # fills all of a view, returns count (fewer: EOF), for reads of known length (TLS: tls_fast.py); or None
        self.read_exactly = None
        # (bytes, read): a frame whose buffers hold that many bytes or more is read by read(kind, seq, ack,
        # meta, lengths, targets, pool) once its metadata is in (tcp_streams.py: striped over several sockets)
        self.big = None
        self._stage = bytearray(self.STAGE)
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0

    @property
    def staged(self) -> int:
        return self._end - self._start

    def _fill(self, need: int) -> None:
        """Ensure ``need`` bytes are staged (need <= STAGE)."""
        if self._end - self._start >= need:
            return
        if self._start:
            n = self._end - self._start
            self._view[:n] = self._view[self._start:self._end]
            self._start, self._end = 0, n
        limit = max(need, self.READ_AHEAD)
        while self._end < need:
            got = self.recv_into(self._view[self._end:limit])
            if got == 0:
                raise EOFError
            self._end += got

    def _take(self, n: int) -> memoryview:
        """The next ``n`` bytes, valid until the next read (copied out when bigger than the stage)."""
        if n > self.STAGE:
            big = memoryview(bytearray(n))
            self.read_into(big)
            return big
        if self._end - self._start < n:
            self._fill(n)
        out = self._view[self._start:self._start + n]
        self._start += n
        return out

    def read_into(self, dest: memoryview) -> None:
        n = dest.nbytes
        staged = min(n, self._end - self._start)
        if staged:
            dest[:staged] = self._view[self._start:self._start + staged]
            self._start += staged
        pos = staged
        if pos < n and self.read_exactly is not None:
            pos += self.read_exactly(dest[pos:])
        while pos < n:
            got = self.recv_into(dest[pos:])
            if got == 0:
                raise EOFError
            pos += got

    def read_frame(self, limits: Limits, pool: BufferPool, into: Into | None = None) -> Frame:
        if self._end - self._start < HEADER.size:
            self._fill(HEADER.size)
        start = self._start
        magic, version, kind, flags, seq, ack, meta_len, nbufs = HEADER.unpack_from(self._stage, start)
        kind = _KINDS.get(kind)
        if (kind is None or magic != MAGIC or version != wire.PROTOCOL_VERSION or flags & ~KNOWN_FLAGS
                or meta_len > limits.max_meta_bytes or nbufs > limits.max_buffers):
            h = decode_header(self._view[start:start + HEADER.size], limits)  # raises, naming the field
            kind, meta_len, nbufs = h.kind, h.meta_len, h.nbufs
        pos = self._start = start + HEADER.size
        if not nbufs:
            lengths = []
        elif nbufs <= 64 and self._end - pos >= 8 * nbufs:  # staged: unpack in place
            lengths = list(_LENGTH_STRUCTS[nbufs].unpack_from(self._stage, pos))
            self._start = pos + 8 * nbufs
            if meta_len + sum(lengths) > limits.max_frame_bytes:
                decode_lengths(self._view[pos:pos + 8 * nbufs], nbufs, meta_len, limits)  # raises, naming it
        else:
            lengths = decode_lengths(self._take(8 * nbufs), nbufs, meta_len, limits)
        meta = unpack_meta(self._take(meta_len), limits) if meta_len else None
        if not lengths:
            return Frame(kind, seq, ack, meta)
        targets = into(kind, seq, lengths) if into is not None else None
        if targets is not None and [v.nbytes for v in targets] != lengths:
            targets = None  # not the reply the caller prepared for (an error, say): use the pool
        if self.big is not None and sum(lengths) >= self.big[0]:
            return self.big[1](kind, seq, ack, meta, lengths, targets, pool)
        bufs, leases = [], []
        for i, n in enumerate(lengths):
            if targets is not None:
                dest = targets[i]
                if self._end - self._start >= n:  # staged already: one copy, no call
                    dest[:] = self._view[self._start:self._start + n]
                    self._start += n
                    bufs.append(dest)
                    continue
            elif n <= self.SMALL:
                if self._end - self._start >= n:  # all staged already: one copy out
                    dest = memoryview(bytearray(self._view[self._start:self._start + n]))
                    self._start += n
                    bufs.append(dest)
                    continue
                dest = memoryview(bytearray(n))
            else:
                dest, token = pool.lease(n)
                leases.append(token)
            self.read_into(dest)
            bufs.append(dest)
        releaser = (lambda: [pool.release(t) for t in leases]) if leases else None
        return Frame(kind, seq, ack, meta, bufs, releaser)
