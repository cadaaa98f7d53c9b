"""tcp over several streams: a big frame's bytes striped over extra sockets in parallel, both ways.

One stream (a Python socket on one core, or one TLS socket whose every byte is encrypted on one core)
cannot fill a fast link; several can, as NCCL's sockets do. ``StripedTcp`` is a ``TcpTransport`` on
the main socket plus the session's extra streams (attached at connect: ``tcp_streams_setup.py``).
Every frame goes on the main socket as always, except that a frame whose buffers hold
``stripe_bytes`` or more has them split, as one run of bytes, into one contiguous range per stream:

    main:      prefix (header, lengths, metadata), then range 0
    stream i:  STRIPE header {magic "RGST", count, offset, length}, then range i

``count`` is the number of striped frames before it in that direction, so a stripe that does not
belong to the frame being read is a ``ProtocolError``, as is a length or offset other than the
frame's. Each stream has a thread per direction (a ``_Lane``) that moves its range with ``sendmsg``
or ``recv_into`` straight between the caller's memory and the socket (no copy) while the caller's
thread moves range 0. A dropped stream is a dropped connection: every socket is shut and the error
(``ConnectionLost``) is the caller's, never a hang.
"""
from __future__ import annotations

import queue
import socket
import struct
import threading
from typing import Sequence

from rgpu.errors import ConnectionLost, ProtocolError, RgpuError, translate_os_error

from .tcp import StreamReader
from .tcp import IOV_MAX, TcpTransport, tune
from .wire import HEADER, MAGIC, BufferPool, Frame

STRIPE = struct.Struct("<4sIQQ")   # magic, count (of striped frames before it, mod 2**32), offset, length
STRIPE_MAGIC = b"RGST"
ALIGN = 4096                       # ranges start on page boundaries of the frame's bytes


def ranges(total: int, n: int) -> list[tuple[int, int]]:
    """``total`` bytes cut into ``n`` contiguous (start, stop) ranges, inner bounds page-aligned."""
    bounds = [0] + [(total * i // n) & ~(ALIGN - 1) for i in range(1, n)] + [total]
    return list(zip(bounds, bounds[1:]))


def pieces(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The slices of ``views`` (byte views, back to back) that cover bytes [start, stop) of them."""
    out, pos = [], 0
    for v in views:
        end = pos + v.nbytes
        if end > start and pos < stop:
            out.append(v[max(start - pos, 0):min(stop, end) - pos])
        pos = end
        if pos >= stop:
            break
    return out


class _Job:
    __slots__ = ("done", "error")

    def __init__(self):
        self.done, self.error = threading.Event(), None


class _Lane:
    """One stream's thread for one direction: runs its jobs in order while the caller's thread works."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, *args) -> _Job:
        job = _Job()
        if self._stopped:      # the connection was closed: nothing will run it
            job.error = ConnectionLost("connection closed")
            job.done.set()
        else:
            self._jobs.put((job, fn, args))
        return job

    def stop(self) -> None:
        self._stopped = True
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, fn, args = item
            try:
                fn(*args)
            except BaseException as exc:   # the caller raises it (without the frames that held the views)
                job.error = exc.with_traceback(None)
            finally:
                # the views of the caller's memory go before the caller hears (it may free or reuse it then)
                item = fn = args = None
                job.done.set()


def _send_all(sock, views: list, tls: bool) -> None:
    """Every byte of ``views`` on ``sock`` (blocking): ``sendmsg`` in as few calls as it takes; TLS, one by one."""
    if tls:
        for v in views:
            sock.sendall(v)
        return
    views = [memoryview(v).cast("B") for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views[:IOV_MAX])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def _recv_exactly(sock, view: memoryview, what: str, read_exactly=None) -> None:
    pos, n = 0, view.nbytes
    if read_exactly is not None:          # TLS: the whole view in one C call (tls_fast.py)
        pos = read_exactly(view)
    while pos < n:
        got = sock.recv_into(view[pos:])
        if not got:
            raise ConnectionLost(f"{what} closed with {n - pos} of its {n} bytes still to come")
        pos += got


class StripedTcp(TcpTransport):
    """A tcp connection of ``1 + len(streams)`` sockets; frames of ``stripe_bytes`` or more go striped."""

    def __init__(self, main: TcpTransport, streams: Sequence[socket.socket], stripe_bytes: int):
        super().__init__(main.sock)
        self._reader = main._reader        # what it has read ahead already (frames after the handshake) is ours
        self.streams = list(streams)
        self.stripe_bytes = max(1, int(stripe_bytes))
        n = len(self.streams) + 1
        self._out = [_Lane(f"rgpu-tcp-stream{i}-out") for i in range(1, n)]
        self._in = [_Lane(f"rgpu-tcp-stream{i}-in") for i in range(1, n)]
        self._sent = self._received = 0     # striped frames each way so far (the stripes' count)
        self._exact = [None] * len(self.streams)   # TLS: each stream's read of a whole view in C (tune_reads)
        self._reader.big = (self.stripe_bytes, self._read_striped)

    def tune_reads(self, spin_us: float | None, use_c: bool = True) -> None:
        super().tune_reads(spin_us, use_c)
        if self._tls:
            from . import tls_fast

            self._exact = [tls_fast.exact_reader(s, use_c) for s in self.streams]

    @property
    def stream_count(self) -> int:
        return len(self.streams) + 1

    # ---- sending ---------------------------------------------------------------------

    def send(self, parts: Sequence) -> None:
        total = 0
        for p in parts:                     # (a loop, no list, no new view: every small post passes here)
            total += len(p) if type(p) is bytes else p.nbytes if type(p) is memoryview else memoryview(p).nbytes
        if total < self.stripe_bytes:
            return TcpTransport.send(self, parts)   # no frame here can be big: the one-stream path as it was
        if self._closed:
            raise ConnectionLost("connection closed")
        sizes = [len(p) if type(p) is bytes else memoryview(p).nbytes for p in parts]
        jobs, pending, i = [], [], 0
        try:
            while i < len(parts):           # frame by frame: the prefix says how many buffers follow
                head = HEADER.unpack_from(parts[i])
                if head[0] != MAGIC:
                    raise TypeError("tcp streams: send() takes whole frames (a prefix, then one part per buffer)")
                nbufs = head[7]
                frame, i = parts[i:i + 1 + nbufs], i + 1 + nbufs
                if sum(sizes[i - nbufs:i]) < self.stripe_bytes:
                    pending += frame
                    continue
                views = [memoryview(b).cast("B") for b in frame[1:]]
                cuts = ranges(sum(v.nbytes for v in views), self.stream_count)
                for k, (start, stop) in enumerate(cuts[1:]):
                    head = STRIPE.pack(STRIPE_MAGIC, self._sent & 0xFFFFFFFF, start, stop - start)
                    jobs.append(self._out[k].submit(self._guarded, _send_all, self.streams[k],
                                                    [head, *pieces(views, start, stop)], self._tls))
                self._sent += 1
                pending += [frame[0], *pieces(views, *cuts[0])]
            super().send(pending)
            self._wait(jobs, sending=True)
        except BaseException as exc:
            cause = self._fail(jobs)
            if cause is None or cause is exc:
                raise
            raise cause from None

    # ---- receiving -------------------------------------------------------------------

    def _read_striped(self, kind, seq: int, ack: int, meta, lengths: list, targets, pool: BufferPool) -> Frame:
        """StreamReader's hook for a frame of ``stripe_bytes`` or more: its buffers from every stream."""
        bufs, leases = [], []
        for i, n in enumerate(lengths):
            if targets is not None:
                bufs.append(targets[i])
            elif n <= StreamReader.SMALL:
                bufs.append(memoryview(bytearray(n)))
            else:
                dest, token = pool.lease(n)
                bufs.append(dest)
                leases.append(token)
        views = [memoryview(b).cast("B") for b in bufs]
        cuts = ranges(sum(lengths), self.stream_count)
        count, self._received = self._received & 0xFFFFFFFF, self._received + 1
        jobs = [self._in[k].submit(self._guarded, self._read_stripe, k, count, start, stop, pieces(views, start, stop))
                for k, (start, stop) in enumerate(cuts[1:])]
        try:
            for piece in pieces(views, *cuts[0]):
                self._reader.read_into(piece)
            self._wait(jobs, sending=False)
        except BaseException as exc:
            cause = self._fail(jobs)
            for t in leases:
                pool.release(t)
            if cause is None or cause is exc:
                raise
            raise cause from None
        releaser = (lambda: [pool.release(t) for t in leases]) if leases else None
        return Frame(kind, seq, ack, meta, bufs, releaser)

    def _read_stripe(self, k: int, count: int, start: int, stop: int, dests: list) -> None:
        sock, what = self.streams[k], f"tcp stream {k + 1} of {self.stream_count}"
        head = memoryview(bytearray(STRIPE.size))
        _recv_exactly(sock, head, f"{what} (a stripe's header)")
        magic, got, offset, length = STRIPE.unpack(head)
        if magic != STRIPE_MAGIC:
            raise ProtocolError(f"{what}: expected a stripe (magic {STRIPE_MAGIC!r}), got {bytes(magic)!r}")
        if got != count:
            raise ProtocolError(f"{what}: a stripe of striped frame {got} came while frame {count} was being read "
                                "(it names no frame pending here)")
        if (offset, length) != (start, stop - start):
            raise ProtocolError(f"{what}: the stripe holds bytes {offset}+{length} of its frame; this end expected "
                                f"{start}+{stop - start} (a short or misplaced stripe)")
        for d in dests:
            _recv_exactly(sock, d, what, self._exact[k])

    # ---- waiting and failing ---------------------------------------------------------

    def _guarded(self, fn, *args) -> None:
        """A lane's job: when it fails, every socket is shut at once, so the caller's thread, maybe blocked
        on the main socket or another stream, wakes to the error rather than waiting on a dead connection."""
        try:
            fn(*args)
        except BaseException:
            self._shut()
            raise

    def _wait(self, jobs: list, sending: bool) -> None:
        """Until every lane's job is done; a sender meanwhile lets ``on_block`` read the replies its peer
        may be blocked writing (tcp.py's rule for a full socket, here for a full stream)."""
        for job in jobs:
            hook = self.on_block if sending else None
            while not job.done.wait(0.01 if hook is not None else None):
                if hook() is None:
                    hook = None          # no reply can come: just wait
            if job.error is not None:
                raise self._translated(job.error)

    def _translated(self, exc: BaseException) -> BaseException:
        if isinstance(exc, RgpuError):
            return exc
        if isinstance(exc, OSError):
            return ConnectionLost("connection closed") if self._closed else translate_os_error(
                exc, where="moving a stripe over an extra tcp stream")
        return exc

    def _fail(self, jobs: list) -> BaseException | None:
        """A stripe failed or the main socket did: shut every socket (a lane blocked in a read or write
        wakes), then wait for the lanes, so no thread still touches the caller's memory. Returns what a
        lane met (a bad stripe first): the cause, where the main socket's error is only our shutting it."""
        self._shut()
        for job in jobs:
            job.done.wait(5.0)
        errors = [job.error for job in jobs if job.error is not None]
        errors.sort(key=lambda e: not isinstance(e, ProtocolError))
        cause = self._translated(errors[0]) if errors else None
        self.close()       # (only now: an fd closed under a lane still in its call could be reused meanwhile)
        return cause

    def close(self) -> None:
        if self._closed:
            return
        for s in self.streams:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for lane in self._out + self._in:
            lane.stop()
        super().close()

    def give_up_after(self, seconds: float) -> None:
        for s in [self.sock, *self.streams]:   # a stripe blocked on a dead link must fail as soon as the main one
            tune(s, seconds)

    def _shut(self) -> None:
        """Every socket shut both ways: whoever is blocked on one wakes to an error, and so does the peer."""
        for s in [self.sock, *self.streams]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def abort(self) -> None:
        self._shut()
        self.close()
