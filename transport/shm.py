"""The shm transport: client and server on one host, frames through shared memory.

The shared layout (control segment, rings, records) is in ``shm_ring.py``, the
writing side in ``shm_write.py``, the receiving side in ``shm_recv.py``, the
waits in ``shm_wait.py``, the memory (segments, the sender's heap, the peer's
segments) in ``shm_memory.py``, the C path in ``shm_native.py``, the setting up
in ``shm_setup.py``; here: the transport that composes them, and its closing.

Direction 0 is client -> server, 1 is server -> client. A record holds the
frame's prefix (header, lengths, metadata) and its small buffers; a buffer over
``INLINE_MAX`` is copied once into the sender's heap and the receiver reads it
in place: ``recv_frame`` returns views into the segment, and the frame's slot is
cleared when the frame is released or the last of those views is gone. A waiting
side polls (keeping its core for ``busy_s``, yielding it after) until ``spin_s``,
then sleeps on an eventfd. The Unix socket that carried the descriptors stays
open: a dead peer shows as POLLHUP at once.

Ordering: x86 stores are seen in program order, so "write the record, then the
tail" needs no barrier; "set my asleep flag, then read the tail" (and its mirror)
does, and ``_fence`` gets one from a lock (a locked instruction). A wake-up lost
anyway would cost ``BACKSTOP_S``, never a hang. Other CPUs reorder stores, and
Python has no barrier to issue: there shm is not offered (``available()``).
"""
from __future__ import annotations

import os
import platform
import socket
import struct
import threading
import time
from typing import Sequence

from rgpu.errors import ConnectionLost, ProtocolError

from . import shm_fast
from .base import Capabilities, FindShared, Into, Transport, spin_seconds
from .shm_memory import PeerSegments, Segment
from .shm_native import CRing, NativeCalls
from .shm_recv import Receiver
from .shm_ring import (  # noqa: F401  (DESC, INLINE_MAX, KIND_FRAME, NO_SLOT: the layout, for shm's users and tests)
    DESC, INLINE_MAX, KIND_FRAME, MAX_SEGMENT, NO_SLOT, REC, RECORD_MAX, RING_BYTES, RINGS_OFF, SLOTS, SLOTS_OFF, Ends,
    _words,
)
from .shm_wait import Waits
from .shm_write import Writer
from .wire import HEADER, MAGIC, BufferPool, Frame, Limits, as_bytes_view, copied, encode_prefix, pack_meta


def _peer_pid(sock: socket.socket) -> int:
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except (OSError, AttributeError):
        return 0


def available() -> str | None:
    """None when this end can use shm, else why not."""
    if not hasattr(os, "memfd_create") or not hasattr(os, "eventfd") or not hasattr(socket, "send_fds"):
        return "shm needs Linux (memfd_create, eventfd, SCM_RIGHTS)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # the ring's ordering rests on x86's (stores seen in order); elsewhere it would need
        # barriers that Python cannot issue
        return f"shm's ring needs x86-64 store ordering; this is {platform.machine()}"
    return None


class _Out:
    """One frame to send, as this transport's ``frame_parts`` makes it: its fields, the prefix packed on demand."""
    __slots__ = ("kind", "seq", "ack", "flags", "meta", "views", "_prefix")

    def __init__(self, kind: int, seq: int, ack: int, flags: int, meta: bytes, views: list,
                 prefix: bytes | None = None):
        self.kind, self.seq, self.ack, self.flags, self.meta, self.views = kind, seq, ack, flags, meta, views
        self._prefix = prefix

    @property
    def prefix(self) -> bytes:
        if self._prefix is None:
            self._prefix = encode_prefix(self.kind, self.seq, self.ack, self.meta, [v.nbytes for v in self.views],
                                         self.flags)
        return self._prefix


class _WaitSetting:
    """A spin setting of the transport's ``Waits`` (``busy_s``, ``spin_s``, ``spin_yield``): the default
    on the class, the live value on a transport (set it there: the waits see it at once)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return getattr(Waits if obj is None else obj.waits, self.name)

    def __set__(self, obj, value) -> None:
        setattr(obj.waits, self.name, value)


class ShmTransport(Transport):
    """One end of a shm connection, composed of objects that each own their state and are given the
    rest when made (transport/README.md, "Who owns which state"): the ``Ends`` (ring ends, closed
    flag), the ``Waits``, the ``Writer`` (outgoing ring, heap, named regions), the ``PeerSegments``,
    the ``Receiver`` (incoming ring, leases) and, with the C path, its ``CRing`` and ``NativeCalls``.
    The transport itself owns the Unix socket, the control segment, the eventfds, the send and
    receive locks, and the closing."""

    name = "shm"
    busy_s, spin_s, spin_yield = _WaitSetting(), _WaitSetting(), _WaitSetting()
    # A write is a copy into the ring: on the caller's thread it costs less than the hand-off to the
    # connection's I/O thread, whose GIL hand-offs also slowed the caller (GPU host, streamed adds:
    # docs/perf/transport-history.md, run4 and run5). Pinned memory the peer maps is named, not copied.
    capabilities = Capabilities(writes_inline=True, names_shared_memory=True)

    def __init__(self, side: str, sock: socket.socket, control: Segment, efds: list[int],
                 max_segment: int = MAX_SEGMENT, use_c: bool = True, spin_us: float | None = None):
        self.side = side
        self._sock, self._control, self._efds = sock, control, efds
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        out = 0 if side == "client" else 1
        inn = 1 - out
        mem = memoryview(control.mm)
        self._q = q = mem[:SLOTS_OFF].cast("Q")
        tail_out, head_out, asleep_out, waiting_out = _words(out)
        tail_in, head_in, asleep_in, waiting_in = _words(inn)
        data_out, space_out, data_in, space_in = efds[2 * out], efds[2 * out + 1], efds[2 * inn], efds[2 * inn + 1]
        fast = shm_fast.load(use_c)
        c = CRing(fast, control.mm, out, data_out, space_in, q[tail_out], q[head_in]) if fast is not None else None
        self._ends = ends = c.ends if c is not None else Ends(q[tail_out], q[head_in])   # the C path's: moved in C
        self.peer = PeerSegments(sock, max_segment)
        spin_s = max(spin_seconds(spin_us, Waits.spin_s), Waits.busy_s)   # RGPU_SHM_SPIN_US, or the default
        self.waits = Waits(q, tail_in, asleep_in, head_out, waiting_out, ends, data_in, space_out, sock,
                           _peer_pid(sock), self.peer, spin_s, *((c.wait, c.ring) if c is not None else ()))
        self.writer = Writer(q, tail_out, head_out, asleep_out, _ring(mem, out), _slots(mem, out), ends, data_out,
                             sock, self.waits.space, lambda: self.on_block)
        self.receiver = Receiver(q, head_in, waiting_in, _ring(mem, inn), _slots(mem, inn), ends, space_in,
                                 self.peer, self.waits.data, c)
        # what send, send_meta, recv_frame and readable call, one lookup each
        self._write_frame, self._write_meta, self._publish = (self.writer.write_frame, self.writer.write_meta,
                                                              self.writer.publish)
        self._recv, self._wait_data = self.receiver.recv, self.waits.data
        self._n_put = None
        if c is not None:
            self._n_put, self._n_ring, self._n_ring_any = ends.put, c.ring_addr, c.ring_any_addr
            calls = NativeCalls(c, self.waits, self._send_lock, self._recv_lock, self.receiver.recv_c)
            self.lone_call, self.serve = calls.lone_call, calls.serve

    # the ends' fields under their old names: the base class's _close_when_idle sets _closed, tests read _tail
    _tail = property(lambda self: self._ends.tail, lambda self, v: setattr(self._ends, "tail", v))
    _head = property(lambda self: self._ends.head, lambda self, v: setattr(self._ends, "head", v))
    _closed = property(lambda self: self._ends.closed, lambda self, v: setattr(self._ends, "closed", v))
    shared_regions = property(lambda self: self.writer.shared_regions, doc="regions the peer maps, named so far")
    shared_bytes = property(lambda self: self.writer.shared_bytes, doc="bytes sent by naming them, not copied")

    # ---- sending -------------------------------------------------------------------

    def frame_parts(self, kind: int, seq: int, ack: int, meta, views: Sequence[memoryview], flags: int = 0) -> list:
        return [_Out(kind, seq, ack, flags, pack_meta(meta), list(views))]

    def send(self, parts: Sequence) -> None:
        with self._send_lock:
            try:
                if self._ends.closed:
                    raise ConnectionLost("connection closed")
                put = self._n_put    # the C path: a frame for the ring alone written and the tail moved in C
                for out in _frames(parts):
                    if put is None or not put(self._n_ring, out.kind, out.flags, out.seq, out.ack, out.meta,
                                              out.views):
                        self._write_frame(out.prefix, out.views)
                self._publish()
            except (OSError, ValueError, BufferError) as exc:
                raise self._lost(exc, "sending") from None

    def send_meta(self, kind: int, seq: int, meta: bytes, buffers: Sequence = ()) -> None:
        """One frame of packed metadata written straight into the ring (a streamed op's post); ``buffers``
        (a small upload's bytes) are copied into the ring record itself whatever their size, when it fits a
        record: copied at the call, as the caller needs, and read by the peer's C path."""
        if buffers:
            return self._send_copied(kind, seq, meta, buffers)
        blob_len = HEADER.size + len(meta)
        rec_len = (REC.size + blob_len + 7) & ~7
        if rec_len > RECORD_MAX:
            return self.send([_Out(kind, seq, 0, 0, meta, [])])
        with self._send_lock:
            try:
                if self._n_put is not None:      # the C path: the tail moved in C (Ends.put)
                    done = self._n_put(self._n_ring, kind, 0, seq, 0, meta, ())
                    if done:
                        return
                    if done is None:
                        raise ConnectionLost("connection closed")
                elif self._ends.closed:
                    raise ConnectionLost("connection closed")
                self._write_meta(kind, seq, meta, rec_len, blob_len)
                self._publish()
            except (OSError, ValueError, BufferError) as exc:
                raise self._lost(exc, "sending") from None

    def _send_copied(self, kind: int, seq: int, meta: bytes, buffers: Sequence) -> None:
        if self._n_put is not None:
            with self._send_lock:
                done = self._n_put(self._n_ring_any, kind, 0, seq, 0, meta, buffers)
                if done:
                    return
                if done is None:
                    raise ConnectionLost("connection closed")
        # too big for one record, no room now, not plain memory, or no C path: copies, the usual way
        self.send([_Out(kind, seq, 0, 0, meta, copied(buffers))])

    def share_memory(self, find: FindShared) -> bool:
        self.writer.find_shared = find
        return True

    def names(self, address: int, nbytes: int) -> bool:
        return self.writer.names(address, nbytes)

    def settle(self) -> None:
        """Take back what the peer has let go of now (the layer above knows it has: a reply came after)."""
        with self._send_lock:
            if not self._ends.closed:
                self.writer.heap.reap()

    # ---- receiving -----------------------------------------------------------------

    def readable(self, timeout: float) -> bool:
        """Whether a frame is there within ``timeout`` seconds."""
        with self._recv_lock:
            try:
                return self._wait_data(time.monotonic() + max(0.0, timeout))
            except ConnectionLost:
                return True            # recv_frame says so
            except (OSError, ValueError) as exc:
                raise self._lost(exc, "receiving") from None

    def recv_frame(self, limits: Limits, pool: BufferPool, into: Into | None = None) -> Frame:
        with self._recv_lock:
            try:
                return self._recv(limits, pool, into)
            except (OSError, ValueError, BufferError) as exc:
                raise self._lost(exc, "receiving") from None

    # ---- closing -------------------------------------------------------------------

    def _lost(self, exc: BaseException, where: str):
        if isinstance(exc, (ConnectionLost, ProtocolError)):
            return exc
        if self._ends.closed:
            return ConnectionLost("connection closed")
        return ConnectionLost(f"shm {where}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        if not self._ends.closed:
            self._close_when_idle(self._release_resources)

    def _release_resources(self) -> None:
        self.writer.close()
        self.receiver.close()
        self._q.release()
        self.peer.close()
        self._control.close()
        for fd in self._efds:
            os.close(fd)
        self._efds = []
        self._sock.close()


def _ring(mem: memoryview, d: int) -> memoryview:
    """The ring of direction ``d`` in the control segment."""
    return mem[RINGS_OFF + d * RING_BYTES:RINGS_OFF + (d + 1) * RING_BYTES]


def _slots(mem: memoryview, d: int) -> memoryview:
    """The slot table of direction ``d`` (1 while the receiver holds a frame's heap buffers)."""
    return mem[SLOTS_OFF + d * SLOTS:SLOTS_OFF + (d + 1) * SLOTS]


def _frames(parts: Sequence):
    """Each frame in ``parts`` as an ``_Out``: this transport's frames, or plain prefix + buffer parts."""
    i, n = 0, len(parts)
    while i < n:
        part = parts[i]
        if type(part) is _Out:
            yield part
            i += 1
            continue
        prefix = bytes(part)
        if prefix[:4] != MAGIC:
            raise TypeError("shm sends whole frames: build the parts with frame_parts")
        _, _, kind, flags, seq, ack, meta_len, nbufs = HEADER.unpack_from(prefix)
        meta = prefix[len(prefix) - meta_len:] if meta_len else b""
        yield _Out(kind, seq, ack, flags, meta, [as_bytes_view(v) for v in parts[i + 1:i + 1 + nbufs]], prefix)
        i += 1 + nbufs

