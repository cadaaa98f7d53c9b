"""The shm transport's receiving side: records read, big buffers read in place, and their memory let go.

A frame's small buffers are copied out of the ring; big ones are views into the
sender's segment, whose slot is cleared once the frame is released or its last
view dies. The wait for a record is ``shm_wait.Waits``'s, the peer's segments
``shm_memory.PeerSegments``'s; with the C path (``shm_native.CRing``) a frame
wholly in the ring is found and checked in C, the Python path the reference.
"""
from __future__ import annotations

import os
import weakref
from typing import Callable

from rgpu.errors import ProtocolError

from . import fastcopy
from .shm_fast import FAST_BUFS, FRAME_BUFS, FRAME_HEAD
from .base import Into
from .shm_memory import PeerSegments
from .shm_ring import (
    BLOB, DESC, KIND_FRAME, KIND_WRAP, KNOWN_KINDS, NO_SLOT, REC, REC_HEAD, RECORD_MAX, RING_BYTES, SLOTS, _KINDS,
    _fence, _lengths,
)
from .wire import (
    HEADER, KNOWN_FLAGS, MAGIC, PROTOCOL_VERSION, BufferPool, Frame, Limits, as_bytes_view, decode_header, decode_lengths, unpack_meta,
)


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


class _Lease:
    """A received frame's hold on its heap slot: let go on release() or when its last in-place view dies.
    Owns the count of live views and whether it let go; given ``let_go(slot)`` (``Receiver.release_slot``)."""
    __slots__ = ("let_go", "slot", "live", "done", "__weakref__")

    def __init__(self, let_go: Callable[[int], None], slot: int):
        self.let_go, self.slot, self.live, self.done = let_go, slot, 0, False

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
            self.let_go(self.slot)


class Receiver:
    """One end's incoming ring, and the state it owns: the ring's and the incoming slot table's views (the
    head it moves is the ``Ends``'s, published here as records are consumed).

    Given when made: the control words ``q`` and the indexes of the incoming head and the peer's waiting
    word, the ring and slot table views (released at ``close``), the ``Ends``, the space eventfd to
    wake the peer, the ``PeerSegments`` (``segment(id)``), the wait for a record (``Waits.data``) and
    the C path (``CRing``), or None. Called under the transport's receive lock.
    """

    def __init__(self, q: memoryview, head_in: int, waiting_in: int, ring: memoryview, slots: memoryview, ends,
                 space_in: int, peer: PeerSegments, wait_data: Callable[..., bool], c=None):
        self._q, self._head_in, self._waiting_in = q, head_in, waiting_in
        self._ring_in, self._slots_in = ring, slots
        self._ends, self._space_in = ends, space_in
        self._segment, self._wait_data = peer.segment, wait_data
        self._c_take = self._n_take = None
        if c is not None:     # what the hot path calls, one lookup each
            self._c_take, self._c_consume, self._n_take = c.take, c.consume, c.take_objects
            self._c_ring, self._n_ring, self._c_frame, self._n_frame = c.ring, c.ring_addr, c.frame, c.frame_addr
            self._c_frame_words = c.frame_words

    def close(self) -> None:
        """Let go of the ring and slot table views (the transport's release, locks held)."""
        self._ring_in.release()
        self._slots_in.release()

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

    def recv(self, limits: Limits, pool: BufferPool, into: Into | None) -> Frame:
        """The next frame (waiting for it), buffers where ``into`` says or pool leases; ``ProtocolError``
        naming what is wrong with a record, ``ConnectionLost`` from the wait."""
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
                frame = self.recv_c(limits, into)
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

    def recv_c(self, limits: Limits, into: Into | None) -> Frame | None:
        """The frame ``rgpu_shm_take`` found and checked (wholly in the ring), or None for the Python path
        (the C lone call calls it too)."""
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
        lease = _Lease(self.release_slot, slot) if slot != NO_SLOT else None
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

    def release_slot(self, slot: int) -> None:
        """The frame in ``slot`` let go: the peer may reuse its heap memory (woken if it waits)."""
        if self._ends.closed:
            return
        try:
            self._slots_in[slot] = 0
            _fence()
            if self._q[self._waiting_in]:
                os.eventfd_write(self._space_in, 1)
        except (OSError, ValueError):
            pass  # closing under us: nothing waits for this slot any more
