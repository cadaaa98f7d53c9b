"""The shm transport's receiving side: waiting for a record, reading it, and letting its memory go.

A waiting side polls the tail (keeping its core for ``busy_s``, yielding it
after) until ``spin_s``, then sleeps on an eventfd; the Unix socket that carried
the descriptors also says when the peer is gone (POLLHUP). A frame's small
buffers are copied out of the ring; big ones are views into the sender's
segment, whose slot is cleared once the frame is released or its last view dies.
``Receiving`` is a part of ``ShmTransport`` (shm.py), kept in its own file.
"""
from __future__ import annotations

import os
import socket
import time
import weakref

from rgpu.errors import ConnectionLost, ProtocolError

from . import fastcopy
from .shm_fast import FAST_BUFS, FRAME_BUFS, FRAME_HEAD
from .base import Into
from .buffers import BufferPool, as_bytes_view
from .shm_memory import Segment
from .shm_ring import (
    BACKSTOP_S, BLOB, CORE_CHECK_S, CTL_MSG, DESC, KIND_FRAME, KIND_WRAP, KNOWN_KINDS, NO_SLOT, OP_DROP, OP_SEGMENT,
    REC, REC_HEAD, RECORD_MAX, RING_BYTES, SHARED_CORE_S, SLOTS, _KINDS, _drain, _fence, _lengths, recv_fds,
)
from .wire import HEADER, KNOWN_FLAGS, MAGIC, PROTOCOL_VERSION, Frame, Limits, decode_header, decode_lengths, unpack_meta


def _spin(q, tail: int, head: int, busy: float, end: float, yield_core: bool) -> int:
    """Poll the tail until ``end``, keeping the core until ``busy`` and yielding it after.

    0: nothing came; 1: data came; 2: it came as a yield returned late (something ran in our
    place: most likely the peer, on our core, so keeping the core only delays it).
    """
    clock = time.perf_counter
    while (now := clock()) < end:
        if q[tail] != head:
            return 1
        if now > busy and yield_core:
            os.sched_yield()
            if clock() - now > 3e-6 and q[tail] != head:
                return 2
    return 1 if q[tail] != head else 0


def _ring_buffers(ring, p: int, lengths: list, into: Into | None, kind, seq: int) -> list:
    """A frame's small buffers, back to back from ``p`` in the ring, copied out: into the caller's targets
    when ``into`` gives ones of these sizes, else each into a fresh bytearray (cheaper than a lease)."""
    targets = into(kind, seq, lengths) if into is not None else None
    if targets is not None:
        targets = [as_bytes_view(v) for v in targets]
        if [v.nbytes for v in targets] != lengths:
            targets = None  # not the reply the caller prepared for (an error, say)
    bufs = []
    for i, n in enumerate(lengths):
        if targets is not None:
            dest = targets[i]
            dest[:] = ring[p:p + n]
        else:
            dest = memoryview(bytearray(ring[p:p + n]))
        bufs.append(dest)
        p += n
    return bufs


def _cpu_of(path: str) -> int:
    with open(path, "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[36])   # field 39 of stat: the CPU it last ran on


def _same_core(peer: int) -> bool:
    """Whether the peer process last ran on the CPU this thread runs on (a cheap look, taken rarely)."""
    if peer <= 0 or peer == os.getpid():
        return False
    try:
        return _cpu_of("/proc/thread-self/stat") == _cpu_of(f"/proc/{peer}/stat")
    except (OSError, ValueError, IndexError):
        return False


class _Lease:
    """A received frame's hold on its heap slot: let go on release() or when its last in-place view dies."""
    __slots__ = ("transport", "slot", "live", "done", "__weakref__")

    def __init__(self, transport: "Receiving", slot: int):
        self.transport, self.slot, self.live, self.done = transport, slot, 0, False

    def track(self, arr) -> None:
        self.live += 1
        weakref.finalize(arr, self._gone)

    def _gone(self) -> None:
        self.live -= 1
        if self.live <= 0:
            self.release()

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.transport._release_slot(self.slot)


class Receiving:
    """ShmTransport's receiving methods (the attributes they use are set in its ``__init__``)."""

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

    def _busy_s(self, now: float) -> float:
        """How long a wait keeps its core before yielding it: none while the peer shares our core."""
        return self.busy_s if now >= self._ends.shared_until else 0.0

    def _wait_data(self, deadline: float | None = None) -> bool:
        q, tail, head = self._q, self._tail_in, self._ends.head
        if q[tail] != head:
            return True
        now = time.perf_counter()
        end = now + (0.0 if self._spun else self.spin_s)   # the C loop of serve() spun just now: sleep
        self._spun = False
        if deadline is not None:
            end = min(end, now + deadline - time.monotonic())
        busy_s = self._busy_s(now)
        if self._c_wait is not None:   # the same spin in C, without the GIL
            got = self._c_wait(self._c_ring, head, busy_s, end - now, self.spin_yield)
        else:
            got = _spin(q, tail, head, now + busy_s, end, self.spin_yield)
        if got == 2 and now > self._core_checked + CORE_CHECK_S:
            self._core_checked = now
            if _same_core(self._peer_pid):
                self._ends.shared_until = now + SHARED_CORE_S    # keeping the core only delays the peer
        if got:
            return True
        while True:
            if self._ends.closed:
                raise ConnectionLost("connection closed")
            q[self._asleep_in] = 1
            _fence()
            if q[tail] != head:
                q[self._asleep_in] = 0
                return True
            if self._peer_gone:
                q[self._asleep_in] = 0
                raise ConnectionLost("the peer closed the shm connection")
            wait = BACKSTOP_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    q[self._asleep_in] = 0
                    return False
            events = self._poll_data.poll(wait * 1000)
            q[self._asleep_in] = 0
            for fd, _ev in events:
                if fd == self._data_in:
                    _drain(fd)
                elif not self._ends.closed:
                    self._service_control()
            if q[tail] != head:
                return True

    def _service_control(self, block: bool = False) -> None:
        """Read what the peer said on the Unix socket: new heap segments, dropped ones, or its end."""
        while not self._peer_gone:
            try:
                msg, fds = recv_fds(self._sock, CTL_MSG.size, 4, 0 if block else socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionResetError:
                msg, fds = b"", []
            if not msg:
                self._peer_gone = True
                for fd in fds:
                    os.close(fd)
                return
            if len(msg) != CTL_MSG.size:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"shm: control message of {len(msg)} bytes")
            op, seg_id, size = CTL_MSG.unpack(msg)
            if op == OP_SEGMENT and len(fds) == 1 and seg_id not in self._in_segs:
                self._in_segs[seg_id] = Segment.attach(seg_id, fds[0], size, self._max_segment)
            elif op == OP_DROP and not fds and seg_id in self._in_segs:
                self._in_segs.pop(seg_id).close()
            else:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"shm: bad control message (op {op}, segment {seg_id}, {len(fds)} fds)")
            if block:
                return

    def _segment(self, seg_id: int) -> Segment:
        seg = self._in_segs.get(seg_id)
        if seg is None:
            self._service_control()      # announced before the record that uses it: already queued
            seg = self._in_segs.get(seg_id)
        if seg is None:
            raise ProtocolError(f"shm: record names segment {seg_id}, never announced")
        return seg

    def _next_record(self) -> tuple[int, int, int, int, int, int]:
        ring = self._ring_in
        while True:
            self._wait_data()
            pos = self._ends.head % RING_BYTES
            rec_len, kind = REC_HEAD.unpack_from(ring, pos)          # positions are 8-aligned: always fits
            if kind == KIND_WRAP:
                if pos + rec_len != RING_BYTES:
                    raise ProtocolError("shm: wrap marker does not reach the end of the ring")
                self._ends.head += rec_len
                continue
            if rec_len % 8 or rec_len < REC.size or pos + rec_len > RING_BYTES:
                raise ProtocolError(f"shm: record length {rec_len} at ring offset {pos}")
            if kind != KIND_FRAME or rec_len > RECORD_MAX:
                raise ProtocolError(f"shm: record kind {kind}, length {rec_len}")
            return (pos, *REC.unpack_from(ring, pos))

    def _recv(self, limits: Limits, pool: BufferPool, into: Into | None) -> Frame:
        if self._c_take is not None:
            self._wait_data()    # the spin (in C), the same-core check, the eventfd: as on the Python path
            if into is None:     # the frame as Python objects, its record consumed, in one call
                got = self._n_take(self._n_ring, self._n_frame, self._ends.head, limits.max_meta_bytes,
                                   limits.max_buffers, limits.max_frame_bytes, KNOWN_KINDS)
                if type(got) is tuple:
                    kind, seq, ack, meta, bufs = got
                    self._ends.head = self._c_frame.next
                    return Frame(_KINDS[kind], seq, ack, unpack_meta(meta, limits) if meta else None, bufs)
            else:
                got = self._c_take(self._c_ring, self._ends.head, limits.max_meta_bytes, limits.max_buffers,
                                   limits.max_frame_bytes, self._c_frame)
            if got == 1:
                frame = self._recv_c(limits, into)
                if frame is not None:
                    return frame
            if got:
                self._ends.head = self._c_frame.head     # past any wrap marker; the Python path reads the rest
        pos, rec_len, _, slot, ndesc, blob_len, blob_in_heap = self._next_record()
        if ndesc == 0 and slot == NO_SLOT and not blob_in_heap:
            return self._recv_inline(pos, rec_len, blob_len, limits, into)
        return self._recv_placed(pos, rec_len, slot, ndesc, blob_len, blob_in_heap, limits, pool, into)

    def _recv_inline(self, pos: int, rec_len: int, blob_len: int, limits: Limits, into: Into | None) -> Frame:
        """A frame wholly in the ring (the common case): checks inlined, small buffers copied out."""
        ring = self._ring_in
        start = pos + REC.size
        end = start + blob_len
        if REC.size + blob_len > rec_len or blob_len < HEADER.size:
            raise ProtocolError("shm: record shorter than its contents")
        magic, version, kind, flags, seq, ack, meta_len, nbufs = HEADER.unpack_from(ring, start)
        msg_kind = _KINDS.get(kind)
        if (magic != MAGIC or version != PROTOCOL_VERSION or msg_kind is None or flags & ~KNOWN_FLAGS
                or meta_len > limits.max_meta_bytes or nbufs > limits.max_buffers):
            decode_header(ring[start:start + HEADER.size], limits)   # raises, naming the field
        p = start + HEADER.size
        if p + 8 * nbufs + meta_len > end:
            raise ProtocolError("shm: prefix shorter than its lengths and metadata")
        lengths = _lengths(nbufs).unpack_from(ring, p) if nbufs else ()
        p += 8 * nbufs
        if p + meta_len + sum(lengths) != end:
            raise ProtocolError("shm: inline buffers do not fill the record")
        if meta_len + sum(lengths) > limits.max_frame_bytes:
            decode_lengths(ring[start + HEADER.size:p], nbufs, meta_len, limits)  # raises
        meta = unpack_meta(ring[p:p + meta_len], limits) if meta_len else None
        p += meta_len
        bufs = _ring_buffers(ring, p, list(lengths), into, msg_kind, seq) if lengths else []
        self._consume(rec_len)
        return Frame(msg_kind, seq, ack, meta, bufs)

    def _recv_c(self, limits: Limits, into: Into | None) -> Frame | None:
        """The frame ``rgpu_shm_take`` found and checked (wholly in the ring), or None for the Python path."""
        words = self._c_frame_words
        _, nxt, seq, ack, kind, meta_len, nbufs, meta_off = FRAME_HEAD.unpack_from(words)
        msg_kind = _KINDS.get(kind)
        if msg_kind is None:
            return None      # the Python path names what is wrong
        ring = self._ring_in
        meta = unpack_meta(ring[meta_off:meta_off + meta_len], limits) if meta_len else None
        bufs = []
        if nbufs:   # back to back from the first one's offset, as rgpu_shm_take checked
            places = FRAME_BUFS.unpack_from(words, FRAME_HEAD.size)
            bufs = _ring_buffers(ring, places[0], list(places[FAST_BUFS:FAST_BUFS + nbufs]), into, msg_kind, seq)
        self._ends.head = nxt
        self._c_consume(self._c_ring, nxt)
        return Frame(msg_kind, seq, ack, meta, bufs)

    def _recv_placed(self, pos: int, rec_len: int, slot: int, ndesc: int, blob_len: int, blob_in_heap: int,
                     limits: Limits, pool: BufferPool, into: Into | None) -> Frame:
        """A frame with buffers (or its prefix) in the sender's heap: big buffers read in place."""
        ring = self._ring_in
        if REC.size + DESC.size * ndesc + (0 if blob_in_heap else blob_len) > rec_len:
            raise ProtocolError("shm: record shorter than its contents")
        if slot != NO_SLOT and slot >= SLOTS:
            raise ProtocolError(f"shm: slot {slot} out of range")
        descs = [DESC.unpack_from(ring, pos + REC.size + DESC.size * k) for k in range(ndesc)]
        blob = None
        places = {}
        for index, sid, off in descs:
            seg = self._segment(sid)
            if index == BLOB:
                if off + blob_len > seg.size or not blob_in_heap:
                    raise ProtocolError("shm: prefix outside its segment")
                blob = seg.view(off, blob_len)
            else:
                places[index] = (seg, off)
        if blob is None:
            if blob_in_heap:
                raise ProtocolError("shm: record says its prefix is in the heap but names no place")
            start = pos + REC.size + DESC.size * ndesc
            blob = ring[start:start + blob_len]
        if blob_len < HEADER.size:
            raise ProtocolError("shm: prefix shorter than a header")
        h = decode_header(blob, limits)
        p = HEADER.size + 8 * h.nbufs
        if p + h.meta_len > blob_len:
            raise ProtocolError("shm: prefix shorter than its lengths and metadata")
        lengths = decode_lengths(blob[HEADER.size:p], h.nbufs, h.meta_len, limits)
        meta = unpack_meta(blob[p:p + h.meta_len], limits)
        p += h.meta_len
        if len(places) != len(descs) - (1 if blob_in_heap else 0) or any(i >= h.nbufs for i in places):
            raise ProtocolError("shm: buffer places do not match the frame's buffers")
        if p + sum(n for i, n in enumerate(lengths) if i not in places) != blob_len:
            raise ProtocolError("shm: inline buffers do not fill the record")
        for i, (seg, off) in places.items():
            if off + lengths[i] > seg.size:
                raise ProtocolError(f"shm: buffer {i} runs past the end of segment {seg.id}")
        if places and slot == NO_SLOT:
            raise ProtocolError("shm: heap buffers without a slot")
        targets = into(h.kind, h.seq, lengths) if (into is not None and lengths) else None
        if targets is not None:
            targets = [as_bytes_view(v) for v in targets]
            if [v.nbytes for v in targets] != lengths:
                targets = None  # not the reply the caller prepared for (an error, say): use the pool
        lease = _Lease(self, slot) if slot != NO_SLOT else None
        bufs, tokens = [], []
        for i, n in enumerate(lengths):
            if i in places:
                seg, off = places[i]
                if targets is not None:
                    fastcopy.copy(targets[i], seg.view(off, n))
                    bufs.append(targets[i])
                else:
                    arr = seg.array[off:off + n]
                    lease.track(arr)
                    bufs.append(memoryview(arr))
            else:
                if targets is not None:
                    dest = targets[i]
                else:
                    dest, token = pool.lease(n)
                    tokens.append(token)
                dest[:] = blob[p:p + n]
                p += n
                bufs.append(dest)
        del blob
        self._consume(rec_len)
        if lease is not None and lease.live == 0:
            lease.release()                  # nothing read in place: the heap memory can go back now
            lease = None

        def releaser():
            if lease is not None:
                lease.release()
            for t in tokens:
                pool.release(t)
        return Frame(h.kind, h.seq, h.ack, meta, bufs, releaser if (lease is not None or tokens) else None)

    def _consume(self, rec_len: int) -> None:
        q = self._q
        self._ends.head += rec_len
        q[self._head_in] = self._ends.head
        _fence()
        if q[self._waiting_in]:
            os.eventfd_write(self._space_in, 1)

    def _release_slot(self, slot: int) -> None:
        if self._ends.closed:
            return
        try:
            self._slots_in[slot] = 0
            _fence()
            if self._q[self._waiting_in]:
                os.eventfd_write(self._space_in, 1)
        except (OSError, ValueError):
            pass  # closing under us: nothing waits for this slot any more
