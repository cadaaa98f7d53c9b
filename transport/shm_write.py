"""shm's writing side: records laid out at the ring's tail, big buffers in the heap or named, the tail published.

A frame wholly in the ring is one record (its prefix and buffers back to back);
a buffer over ``INLINE_MAX`` is copied once into the heap (``Heap``), or named
where it lies in memory the peer maps already (``find_shared``), and the record
carries its place. A full ring or heap waits (``Waits.space``) for the receiver
to let go; the tail the peer sees moves only at ``publish``.
"""
from __future__ import annotations

import os
import socket
from typing import Callable

import numpy as np

from . import fastcopy
from .base import FindShared
from .shm_memory import Heap, Segment
from .shm_ring import (
    BLOB, CTL_MSG, DESC, INLINE_MAX, KIND_FRAME, KIND_WRAP, MAX_PLACED, NO_SLOT, OP_DROP, OP_SEGMENT, REC, REC_HEAD,
    RECORD_MAX, RING_BYTES, _fence,
)
from .wire import HEADER, MAGIC, PROTOCOL_VERSION


class Writer:
    """One end's outgoing ring, and the state it owns: the ring's bytes, the sender's ``Heap`` (made here,
    over the outgoing slot table), the regions the peer maps by their base address (``find_shared``,
    ``shared_regions``, ``shared_bytes``).

    Given when made: the control words ``q`` and the indexes of the outgoing tail, head and asleep
    words, the ring and slot table views (released at ``close``), the ``Ends`` (its tail moved here),
    the data eventfd to wake the peer, the Unix socket (segments announced and dropped), the wait for
    space (``Waits.space``) and ``on_block()`` (the transport's hook as the connection set it, or None).
    Called under the transport's send lock.
    """

    find_shared: FindShared | None = None   # given by the layer above (share_memory)

    def __init__(self, q: memoryview, tail_out: int, head_out: int, asleep_out: int, ring: memoryview,
                 slots: memoryview, ends, data_out: int, sock: socket.socket,
                 wait_space: Callable, on_block: Callable[[], Callable | None]):
        self._q, self._tail_out, self._head_out, self._asleep_out = q, tail_out, head_out, asleep_out
        self.ring = ring
        self._ends, self._data_out, self._sock = ends, data_out, sock
        self._wait_space, self._on_block = wait_space, on_block
        self.heap = Heap(slots, self._announce, self._drop)
        self._shared: dict[int, int] = {}      # base address of a region the peer maps -> its segment id
        self.shared_regions = self.shared_bytes = 0

    def reserve(self, need: int) -> int:
        """Room for a record of ``need`` bytes at the tail (a wrap marker first if it would not fit)."""
        q = self._q
        while True:
            pos = self._ends.tail % RING_BYTES
            wrap = RING_BYTES - pos if pos + need > RING_BYTES else 0
            if self._ends.tail - q[self._head_out] + wrap + need <= RING_BYTES:
                if wrap:
                    REC_HEAD.pack_into(self.ring, pos, wrap, KIND_WRAP)   # may be all of 8 bytes
                    self._ends.tail += wrap
                    pos = 0
                return pos
            self.publish()
            self._wait_space(lambda: self._ends.tail - q[self._head_out] + wrap + need <= RING_BYTES,
                             self._on_block())

    def publish(self) -> None:
        """The tail where the peer sees it, the peer woken if it sleeps."""
        q = self._q
        if q[self._tail_out] == self._ends.tail:
            return
        q[self._tail_out] = self._ends.tail
        _fence()
        if q[self._asleep_out]:
            os.eventfd_write(self._data_out, 1)

    def write_meta(self, kind: int, seq: int, meta: bytes, rec_len: int, blob_len: int) -> None:
        """A frame of packed metadata and no buffer as one record of ``rec_len`` (unpublished)."""
        pos = self.reserve(rec_len)
        ring = self.ring
        REC.pack_into(ring, pos, rec_len, KIND_FRAME, NO_SLOT, 0, blob_len, 0)
        HEADER.pack_into(ring, pos + REC.size, MAGIC, PROTOCOL_VERSION, kind, 0, seq, 0, len(meta), 0)
        p = pos + REC.size + HEADER.size
        ring[p:p + len(meta)] = meta
        self._ends.tail += rec_len

    def write_frame(self, prefix: bytes, views: list) -> None:
        """A frame as one record (unpublished): in the ring, or with its big buffers (and, if need be, its
        prefix) in the heap or named in place."""
        lengths = [v.nbytes for v in views]
        blob_len = len(prefix) + sum(lengths)
        if REC.size + blob_len <= RECORD_MAX and (not lengths or max(lengths) <= INLINE_MAX):
            rec_len = (REC.size + blob_len + 7) & ~7      # the common case: everything in the ring
            pos = self.reserve(rec_len)
            ring = self.ring
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
        heap = self.heap
        sizes = [lengths[i] for i in big] + ([blob_len] if blob_in_heap else [])
        slot, places = self._alloc(sizes)
        if descs:
            heap.hold(slot, [views[d[0]] for d in descs])
        for i, (sid, off) in zip(big, places):
            fastcopy.copy(heap.view(sid, off, lengths[i]), views[i])
            descs.append((i, sid, off))
        if blob_in_heap:
            sid, off = places[-1]
            _pack_blob(heap.view(sid, off, blob_len), 0, prefix, views, placed)
            descs.append((BLOB, sid, off))
        rec_len = (REC.size + DESC.size * len(descs) + (0 if blob_in_heap else blob_len) + 7) & ~7
        pos = self.reserve(rec_len)
        ring = self.ring
        REC.pack_into(ring, pos, rec_len, KIND_FRAME, slot, len(descs), blob_len, int(blob_in_heap))
        p = pos + REC.size
        for d in descs:
            DESC.pack_into(ring, p, *d)
            p += DESC.size
        if not blob_in_heap:
            _pack_blob(ring, p, prefix, views, placed)
        self._ends.tail += rec_len

    def names(self, address: int, nbytes: int) -> bool:
        """Whether a buffer there would be named, not copied."""
        return self.find_shared is not None and self.find_shared(address, nbytes) is not None

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
            sid = self._shared[base] = self.heap.new_id()
            self._announce_fd(sid, size, fd)
            self.shared_regions += 1
        self.shared_bytes += view.nbytes
        return sid, addr - base

    def _alloc(self, sizes: list[int]):
        got = self.heap.alloc(sizes)
        while got is None:
            self.publish()
            self._wait_space(self.heap.reap, self._on_block())
            got = self.heap.alloc(sizes)
        return got

    def _announce(self, seg: Segment) -> None:
        self._announce_fd(seg.id, seg.size, seg.fd)

    def _announce_fd(self, seg_id: int, size: int, fd: int) -> None:
        """Pass the peer a memfd to map as segment ``seg_id`` (our heap's, or a region we name)."""
        socket.send_fds(self._sock, [CTL_MSG.pack(OP_SEGMENT, seg_id, size)], [fd])

    def _drop(self, seg_id: int) -> None:
        self._sock.send(CTL_MSG.pack(OP_DROP, seg_id, 0))

    def close(self) -> None:
        """Let go of the ring, the slot table and the heap's segments (the transport's release, locks held)."""
        self.ring.release()
        self.heap.slots.release()
        self.heap.close()


def _pack_blob(dst: memoryview, p: int, prefix: bytes, views: list, placed: set) -> None:
    """The prefix, then every buffer not placed in the heap, back to back."""
    dst[p:p + len(prefix)] = prefix
    p += len(prefix)
    for i, v in enumerate(views):
        if i not in placed:
            n = v.nbytes
            dst[p:p + n] = v
            p += n
