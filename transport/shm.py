"""The shm transport: client and server on one host, frames through shared memory.

The shared layout (control segment, rings, records) is in ``shm_ring.py``, the
receiving side in ``shm_recv.py``, the memory (segments, the sender's heap) in
``shm_memory.py``, the setting up in ``shm_setup.py``; here: the transport, its
sending side and its closing.

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
import select
import socket
import struct
import threading
import time
from typing import Sequence

import numpy as np

from rgpu.errors import ConnectionLost, ProtocolError

from . import fastcopy, shm_fast
from .base import Capabilities, FindShared, Transport, spin_seconds
from .buffers import as_bytes_view, copied
from .shm_memory import Heap, Segment
from .shm_native import NativeCalls
from .shm_recv import Receiving
from .shm_ring import (
    BACKSTOP_S, BLOB, CTL_MSG, DESC, INLINE_MAX, KIND_FRAME, KIND_WRAP, MAX_PLACED, MAX_SEGMENT, NO_SLOT, OP_DROP,
    OP_SEGMENT, REC, REC_HEAD, RECORD_MAX, RING_BYTES, RINGS_OFF, SLOTS, SLOTS_OFF, Ends, _drain, _fence, _words,
)
from .wire import HEADER, MAGIC, PROTOCOL_VERSION, encode_prefix, pack_meta




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


class ShmTransport(Receiving, NativeCalls, Transport):
    name = "shm"
    # A waiting side polls busy_s keeping its core, then yields it until spin_s, then sleeps on its
    # eventfd. When data arrives just as a yield comes back late and the peer last ran on our CPU
    # (/proc, looked at most every CORE_CHECK_S), it shares our core: for SHARED_CORE_S the receiver
    # yields from the start (keeping the core would only delay the peer). Measured on the shared
    # 2-core machine, docs/perf/transport.md. spin_s: RGPU_SHM_SPIN_US, else base.spin_seconds's
    # default (20 ms on a machine of 8 cores or more, spin_s below elsewhere).
    busy_s = 20e-6
    spin_s = 100e-6
    spin_yield = True
    # A write is a copy into the ring: on the caller's thread it costs less than the hand-off to the
    # connection's I/O thread, whose GIL hand-offs also slowed the caller (GPU host, streamed adds:
    # docs/perf/transport-history.md, run4 and run5). Pinned memory the peer maps is named, not copied.
    capabilities = Capabilities(writes_inline=True, names_shared_memory=True)
    # Given by the layer above (share_memory): find_shared(address, nbytes) -> (memfd, base, size) of host
    # memory holding that range which the peer may map (pinned tensors, pinned.cpp), or None. Such buffers
    # are sent by naming them, with no copy; the sender must leave them alone until the peer let the frame go.
    find_shared: FindShared | None = None

    def __init__(self, side: str, sock: socket.socket, control: Segment, efds: list[int],
                 max_segment: int = MAX_SEGMENT, use_c: bool = True, spin_us: float | None = None):
        self.side = side
        self.spin_s = max(spin_seconds(spin_us, self.spin_s), self.busy_s)   # RGPU_SHM_SPIN_US, or the default
        self._sock = sock
        self._control = control
        self._efds = efds
        self._max_segment = max_segment
        out = 0 if side == "client" else 1
        inn = 1 - out
        self._q = memoryview(control.mm)[:SLOTS_OFF].cast("Q")
        self._tail_out, self._head_out, self._asleep_out, self._waiting_out = _words(out)
        self._tail_in, self._head_in, self._asleep_in, self._waiting_in = _words(inn)
        mem = memoryview(control.mm)
        self._ring_out = mem[RINGS_OFF + out * RING_BYTES:RINGS_OFF + (out + 1) * RING_BYTES]
        self._ring_in = mem[RINGS_OFF + inn * RING_BYTES:RINGS_OFF + (inn + 1) * RING_BYTES]
        self._slots_in = mem[SLOTS_OFF + inn * SLOTS:SLOTS_OFF + (inn + 1) * SLOTS]
        self._data_out, self._space_out = efds[2 * out], efds[2 * out + 1]
        self._data_in, self._space_in = efds[2 * inn], efds[2 * inn + 1]
        self._ends = Ends(self._q[self._tail_out], self._q[self._head_in])   # the C path's, once attached
        self._heap = Heap(mem[SLOTS_OFF + out * SLOTS:SLOTS_OFF + (out + 1) * SLOTS], self._announce, self._drop)
        self._in_segs: dict[int, Segment] = {}
        self._shared: dict[int, int] = {}      # base address of a region the peer maps -> its segment id
        self.shared_regions = self.shared_bytes = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._core_checked = 0.0
        self._spun = False                     # serve() found nothing within its spin: the next wait sleeps
        self._peer_pid = _peer_pid(sock)
        self._peer_gone = False
        self._poll_data = select.poll()
        self._poll_data.register(self._data_in, select.POLLIN)
        self._poll_data.register(sock, select.POLLIN)
        self._poll_space = select.poll()
        self._poll_space.register(self._space_out, select.POLLIN)
        self._poll_space.register(sock, select.POLLRDHUP)
        self._c_wait = self._c_take = self._n_put = None
        fast = shm_fast.load(use_c)
        if fast is not None:
            self._attach_c(fast, control, out)

    # the ends' fields under their old names: the base class's _close_when_idle sets _closed, tests read _tail
    _tail = property(lambda self: self._ends.tail, lambda self, v: setattr(self._ends, "tail", v))
    _head = property(lambda self: self._ends.head, lambda self, v: setattr(self._ends, "head", v))
    _closed = property(lambda self: self._ends.closed, lambda self, v: setattr(self._ends, "closed", v))

    # ---- sending -------------------------------------------------------------------

    def frame_parts(self, kind: int, seq: int, ack: int, meta, views: Sequence[memoryview], flags: int = 0) -> list:
        return [_Out(kind, seq, ack, flags, pack_meta(meta), list(views))]

    def send(self, parts: Sequence) -> None:
        with self._send_lock:
            try:
                if self._ends.closed:
                    raise ConnectionLost("connection closed")
                put = self._n_put
                for out in _frames(parts):
                    if put is None or not self._put_c(out):
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
                    done = self._ends.put(self._n_ring, kind, 0, seq, 0, meta, ())
                    if done:
                        return
                    if done is None:
                        raise ConnectionLost("connection closed")
                elif self._ends.closed:
                    raise ConnectionLost("connection closed")
                pos = self._reserve(rec_len)
                ring = self._ring_out
                REC.pack_into(ring, pos, rec_len, KIND_FRAME, NO_SLOT, 0, blob_len, 0)
                HEADER.pack_into(ring, pos + REC.size, MAGIC, PROTOCOL_VERSION, kind, 0, seq, 0, len(meta), 0)
                p = pos + REC.size + HEADER.size
                ring[p:p + len(meta)] = meta
                self._ends.tail += rec_len
                self._publish()
            except (OSError, ValueError, BufferError) as exc:
                raise self._lost(exc, "sending") from None

    def _send_copied(self, kind: int, seq: int, meta: bytes, buffers: Sequence) -> None:
        if self._n_put is not None:
            with self._send_lock:
                done = self._ends.put(self._n_ring_any, kind, 0, seq, 0, meta, buffers)
                if done:
                    return
                if done is None:
                    raise ConnectionLost("connection closed")
        # too big for one record, no room now, not plain memory, or no C path: copies, the usual way
        self.send([_Out(kind, seq, 0, 0, meta, copied(buffers))])

    def _write_frame(self, prefix: bytes, views: list) -> None:
        lengths = [v.nbytes for v in views]
        blob_len = len(prefix) + sum(lengths)
        if REC.size + blob_len <= RECORD_MAX and (not lengths or max(lengths) <= INLINE_MAX):
            rec_len = (REC.size + blob_len + 7) & ~7      # the common case: everything in the ring
            pos = self._reserve(rec_len)
            ring = self._ring_out
            REC.pack_into(ring, pos, rec_len, KIND_FRAME, NO_SLOT, 0, blob_len, 0)
            p = pos + REC.size
            ring[p:p + len(prefix)] = prefix
            p += len(prefix)
            for v, n in zip(views, lengths):
                ring[p:p + n] = v
                p += n
            self._ends.tail += rec_len
            return
        big = [i for i, n in enumerate(lengths) if n > INLINE_MAX]
        if len(big) > MAX_PLACED:    # a record must fit the ring: the smallest of them join the prefix
            big = sorted(sorted(big, key=lengths.__getitem__, reverse=True)[:MAX_PLACED])
        placed = set(big)
        blob_len = len(prefix) + sum(n for i, n in enumerate(lengths) if i not in placed)
        blob_in_heap = REC.size + DESC.size * (len(big) + 1) + blob_len > RECORD_MAX
        descs = []
        if self.find_shared is not None:   # buffers in memory the peer maps already: named, not copied
            for i in big:
                where = self._shared_place(views[i])
                if where is not None:
                    descs.append((i, *where))
            named = {d[0] for d in descs}
            big = [i for i in big if i not in named]
        sizes = [lengths[i] for i in big] + ([blob_len] if blob_in_heap else [])
        slot, places = self._alloc(sizes)
        if descs:
            self._heap.hold(slot, [views[d[0]] for d in descs])
        for i, (sid, off) in zip(big, places):
            fastcopy.copy(self._heap.view(sid, off, lengths[i]), views[i])
            descs.append((i, sid, off))
        if blob_in_heap:
            sid, off = places[-1]
            _pack_blob(self._heap.view(sid, off, blob_len), 0, prefix, views, placed)
            descs.append((BLOB, sid, off))
        rec_len = (REC.size + DESC.size * len(descs) + (0 if blob_in_heap else blob_len) + 7) & ~7
        pos = self._reserve(rec_len)
        ring = self._ring_out
        REC.pack_into(ring, pos, rec_len, KIND_FRAME, slot, len(descs), blob_len, int(blob_in_heap))
        p = pos + REC.size
        for d in descs:
            DESC.pack_into(ring, p, *d)
            p += DESC.size
        if not blob_in_heap:
            _pack_blob(ring, p, prefix, views, placed)
        self._ends.tail += rec_len

    def share_memory(self, find: FindShared) -> bool:
        self.find_shared = find
        return True

    def names(self, address: int, nbytes: int) -> bool:
        return self.find_shared is not None and self.find_shared(address, nbytes) is not None

    def settle(self) -> None:
        """Take back what the peer has let go of now (the layer above knows it has: a reply came after)."""
        with self._send_lock:
            if not self._ends.closed:
                self._heap.reap()

    def _shared_place(self, view: memoryview) -> tuple[int, int] | None:
        """(segment id, offset) of ``view`` in a region the peer maps (announced on first use), or None."""
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        region = self.find_shared(addr, view.nbytes)
        if region is None:
            return None
        fd, base, size = region
        if not (base <= addr and addr + view.nbytes <= base + size):
            return None
        sid = self._shared.get(base)
        if sid is None:
            sid = self._shared[base] = self._heap.new_id()
            self._announce_fd(sid, size, fd)
            self.shared_regions += 1
        self.shared_bytes += view.nbytes
        return sid, addr - base

    def _alloc(self, sizes: list[int]):
        got = self._heap.alloc(sizes)
        while got is None:
            self._publish()
            self._wait_space(self._heap.reap)
            got = self._heap.alloc(sizes)
        return got

    def _reserve(self, need: int) -> int:
        """Room for a record of ``need`` bytes at the tail (a wrap marker first if it would not fit)."""
        q = self._q
        while True:
            pos = self._ends.tail % RING_BYTES
            wrap = RING_BYTES - pos if pos + need > RING_BYTES else 0
            if self._ends.tail - q[self._head_out] + wrap + need <= RING_BYTES:
                if wrap:
                    REC_HEAD.pack_into(self._ring_out, pos, wrap, KIND_WRAP)   # may be all of 8 bytes
                    self._ends.tail += wrap
                    pos = 0
                return pos
            self._publish()
            self._wait_space(lambda: self._ends.tail - q[self._head_out] + wrap + need <= RING_BYTES)

    def _publish(self) -> None:
        q = self._q
        if q[self._tail_out] == self._ends.tail:
            return
        q[self._tail_out] = self._ends.tail
        _fence()
        if q[self._asleep_out]:
            os.eventfd_write(self._data_out, 1)

    def _wait_space(self, ready) -> None:
        """Until ``ready()``: the receiver frees ring space or heap slots (it wakes us when we say we wait).

        Meanwhile ``on_block`` (a connection's) may read replies the peer is blocked on.
        """
        q = self._q
        now = time.perf_counter()
        busy, end = now + self.busy_s, now + self.spin_s
        while (now := time.perf_counter()) < end:
            if ready():
                return
            if now > busy and self.spin_yield:
                os.sched_yield()
        while True:
            if self._ends.closed:
                raise ConnectionLost("connection closed")
            wait = BACKSTOP_S
            if self.on_block is not None:
                want = self.on_block()
                if want is not None:
                    if ready():
                        return
                    wait = 0.002 if want else 0.01     # a reply may be due: look again soon
            q[self._waiting_out] = 1
            _fence()
            if ready():
                q[self._waiting_out] = 0
                return
            events = self._poll_space.poll(wait * 1000)
            q[self._waiting_out] = 0
            for fd, ev in events:
                if fd == self._space_out:
                    _drain(fd)
                elif ev & (select.POLLHUP | select.POLLRDHUP | select.POLLERR):
                    raise ConnectionLost("connection closed" if self._ends.closed else "the peer went away (shm)")
            if ready():
                return

    def _announce(self, seg: Segment) -> None:
        self._announce_fd(seg.id, seg.size, seg.fd)

    def _announce_fd(self, seg_id: int, size: int, fd: int) -> None:
        """Pass the peer a memfd to map as segment ``seg_id`` (our heap's, or a region we name)."""
        socket.send_fds(self._sock, [CTL_MSG.pack(OP_SEGMENT, seg_id, size)], [fd])

    def _drop(self, seg_id: int) -> None:
        self._sock.send(CTL_MSG.pack(OP_DROP, seg_id, 0))

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
        for view in (self._ring_out, self._ring_in, self._slots_in, self._heap.slots, self._q):
            view.release()
        self._heap.close()
        for seg in self._in_segs.values():
            seg.close()
        self._in_segs.clear()
        self._control.close()
        for fd in self._efds:
            os.close(fd)
        self._efds = []
        self._sock.close()


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


def _pack_blob(dst: memoryview, p: int, prefix: bytes, views: list, placed: set) -> None:
    """The prefix, then every buffer not placed in the heap, back to back."""
    dst[p:p + len(prefix)] = prefix
    p += len(prefix)
    for i, v in enumerate(views):
        if i not in placed:
            n = v.nbytes
            dst[p:p + n] = v
            p += n
