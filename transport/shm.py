"""The shm transport: client and server on one host, frames through shared memory.

    control segment (a sealed memfd the server makes)
      line 0              magic, version, ring size, slots, nonce (read back by the client as proof)
      lines 1..8          per direction d: tail (producer), head (consumer), consumer asleep,
                          producer waiting for space; each on its own cache line
      4 KiB + d * 4 KiB   slot table of direction d (1 while the receiver holds a frame's heap buffers)
      16 KiB + d * RING   ring of direction d: one record per frame
    heap segments         sealed memfds each sender makes for its big buffers, passed over the Unix socket

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

import array
import os
import platform
import select
import socket
import struct
import threading
import time
import weakref
from typing import Callable, Sequence

import numpy as np

from rgpu.errors import ConnectionLost, ProtocolError

from . import fastcopy
from .base import Into, Transport
from .buffers import BufferPool, as_bytes_view
from .shm_memory import Heap, Segment
from .wire import (
    HEADER, KNOWN_FLAGS, MAGIC, PROTOCOL_VERSION, Frame, Limits, MsgKind, decode_header, decode_lengths, encode_prefix,
    pack_meta, unpack_meta,
)

CTL_MAGIC = b"RGPUSHM1"
CTL_VERSION = 1
RING_BYTES = 1 << 20
RECORD_MAX = RING_BYTES // 4
INLINE_MAX = 16 << 10          # bigger buffers go through the heap and are read in place
MAX_PLACED = (RECORD_MAX - 24) // 16 - 1   # heap places one record can name
SLOTS = 4096
SLOTS_OFF = 4096
RINGS_OFF = 16384
CONTROL_BYTES = RINGS_OFF + 2 * RING_BYTES
NONCE_OFF, NONCE_BYTES = 24, 32
CTL_HEAD = struct.Struct("<8sIII")         # magic, version, ring bytes, slots
REC = struct.Struct("<IIIIII")             # length, kind, slot, descriptors, blob length, blob in heap
REC_HEAD = struct.Struct("<II")            # length, kind: all a wrap marker has
DESC = struct.Struct("<IIQ")               # buffer index (BLOB: the prefix itself), segment id, offset
CTL_MSG = struct.Struct("<IIQ")            # op, segment id, size: on the Unix socket
OP_SEGMENT, OP_DROP = 1, 2
KIND_FRAME, KIND_WRAP = 1, 2
NO_SLOT = BLOB = 0xFFFFFFFF
BACKSTOP_S = 0.05
SHARED_CORE_S = 1.0
CORE_CHECK_S = 0.1
MAX_SEGMENT = 16 << 30

_FENCE = threading.Lock()
_KINDS = {int(k): k for k in MsgKind}
_LENGTHS: dict[int, struct.Struct] = {}


def _lengths(n: int) -> struct.Struct:
    st = _LENGTHS.get(n)
    if st is None:
        st = struct.Struct(f"<{n}Q")
        if len(_LENGTHS) < 256:
            _LENGTHS[n] = st
    return st


def _fence() -> None:
    _FENCE.acquire()
    _FENCE.release()


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


def _peer_pid(sock: socket.socket) -> int:
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except (OSError, AttributeError):
        return 0


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


def _word(line: int) -> int:
    return line * 8                      # index of a cache line's first u64


def _words(d: int) -> tuple[int, int, int, int]:
    """(tail, head, asleep, waiting) word indexes of direction d."""
    base = 1 + 4 * d
    return _word(base), _word(base + 1), _word(base + 2), _word(base + 3)


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
    """One frame to send, as this transport's ``frame_parts`` makes it."""
    __slots__ = ("prefix", "views")

    def __init__(self, prefix: bytes, views: list):
        self.prefix, self.views = prefix, views


class _Lease:
    """A received frame's hold on its heap slot: let go on release() or when its last in-place view dies."""
    __slots__ = ("transport", "slot", "live", "done", "__weakref__")

    def __init__(self, transport: "ShmTransport", slot: int):
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


class ShmTransport(Transport):
    name = "shm"
    # A waiting side polls busy_s keeping its core, then yields it until spin_s, then sleeps on its
    # eventfd. When data arrives just as a yield comes back late and the peer last ran on our CPU
    # (/proc, looked at most every CORE_CHECK_S), it shares our core: for SHARED_CORE_S the receiver
    # yields from the start (keeping the core would only delay the peer). Measured on the shared
    # 2-core machine, docs/perf/transport.md.
    busy_s = 20e-6
    spin_s = 100e-6
    spin_yield = True
    # A write is a copy into the ring: on the caller's thread it costs less than the hand-off to the
    # connection's I/O thread (GPU host, 5000 streamed adds: 25 us per op inline, 67 us through the
    # thread, whose GIL hand-offs also slowed the caller; `gpu/diag_client.sh`).
    posts_inline = True
    # Set by the layer above: find_shared(address, nbytes) -> (memfd, base, size) of host memory holding
    # that range which the peer may map (pinned tensors, pinned.cpp), or None. Such buffers are sent by
    # naming them, with no copy; the sender must leave them alone until the peer has let the frame go.
    find_shared: Callable[[int, int], "tuple[int, int, int] | None"] | None = None

    def __init__(self, side: str, sock: socket.socket, control: Segment, efds: list[int],
                 max_segment: int = MAX_SEGMENT):
        self.side = side
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
        self._tail = self._q[self._tail_out]
        self._head = self._q[self._head_in]
        self._heap = Heap(mem[SLOTS_OFF + out * SLOTS:SLOTS_OFF + (out + 1) * SLOTS], self._announce, self._drop)
        self._in_segs: dict[int, Segment] = {}
        self._shared: dict[int, int] = {}      # base address of a region the peer maps -> its segment id
        self.shared_regions = self.shared_bytes = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._shared_until = self._core_checked = 0.0
        self._peer_pid = _peer_pid(sock)
        self._closed = False
        self._peer_gone = False
        self._poll_data = select.poll()
        self._poll_data.register(self._data_in, select.POLLIN)
        self._poll_data.register(sock, select.POLLIN)
        self._poll_space = select.poll()
        self._poll_space.register(self._space_out, select.POLLIN)
        self._poll_space.register(sock, select.POLLRDHUP)

    # ---- sending -------------------------------------------------------------------

    def frame_parts(self, kind: int, seq: int, ack: int, meta, views: Sequence[memoryview], flags: int = 0) -> list:
        views = [as_bytes_view(v) for v in views]
        return [_Out(encode_prefix(kind, seq, ack, pack_meta(meta), [v.nbytes for v in views], flags), views)]

    def send(self, parts: Sequence) -> None:
        with self._send_lock:
            try:
                if self._closed:
                    raise ConnectionLost("connection closed")
                for prefix, views in _frames(parts):
                    self._write_frame(prefix, views)
                self._publish()
            except (OSError, ValueError, BufferError) as exc:
                raise self._lost(exc, "sending") from None

    def send_meta(self, kind: int, seq: int, meta: bytes) -> None:
        """One frame of packed metadata, header and all written straight into the ring (a streamed op's post)."""
        blob_len = HEADER.size + len(meta)
        rec_len = (REC.size + blob_len + 7) & ~7
        if rec_len > RECORD_MAX:
            return self.send([_Out(encode_prefix(kind, seq, 0, meta, ()), [])])
        with self._send_lock:
            try:
                if self._closed:
                    raise ConnectionLost("connection closed")
                pos = self._reserve(rec_len)
                ring = self._ring_out
                REC.pack_into(ring, pos, rec_len, KIND_FRAME, NO_SLOT, 0, blob_len, 0)
                HEADER.pack_into(ring, pos + REC.size, MAGIC, PROTOCOL_VERSION, kind, 0, seq, 0, len(meta), 0)
                p = pos + REC.size + HEADER.size
                ring[p:p + len(meta)] = meta
                self._tail += rec_len
                self._publish()
            except (OSError, ValueError, BufferError) as exc:
                raise self._lost(exc, "sending") from None

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
            self._tail += rec_len
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
            big = [i for i in big if i not in {d[0] for d in descs}]
        sizes = [lengths[i] for i in big] + ([blob_len] if blob_in_heap else [])
        slot, places = self._alloc(sizes)
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
        self._tail += rec_len

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
            socket.send_fds(self._sock, [CTL_MSG.pack(OP_SEGMENT, sid, size)], [fd])
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
            pos = self._tail % RING_BYTES
            wrap = RING_BYTES - pos if pos + need > RING_BYTES else 0
            if self._tail - q[self._head_out] + wrap + need <= RING_BYTES:
                if wrap:
                    REC_HEAD.pack_into(self._ring_out, pos, wrap, KIND_WRAP)   # may be all of 8 bytes
                    self._tail += wrap
                    pos = 0
                return pos
            self._publish()
            self._wait_space(lambda: self._tail - q[self._head_out] + wrap + need <= RING_BYTES)

    def _publish(self) -> None:
        q = self._q
        if q[self._tail_out] == self._tail:
            return
        q[self._tail_out] = self._tail
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
            if self._closed:
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
                    raise ConnectionLost("connection closed" if self._closed else "the peer went away (shm)")
            if ready():
                return

    def _announce(self, seg: Segment) -> None:
        socket.send_fds(self._sock, [CTL_MSG.pack(OP_SEGMENT, seg.id, seg.size)], [seg.fd])

    def _drop(self, seg_id: int) -> None:
        self._sock.send(CTL_MSG.pack(OP_DROP, seg_id, 0))

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

    def _wait_data(self, deadline: float | None = None) -> bool:
        q, tail, head = self._q, self._tail_in, self._head
        if q[tail] != head:
            return True
        now = time.perf_counter()
        end = now + self.spin_s
        if deadline is not None:
            end = min(end, now + deadline - time.monotonic())
        busy = now + (self.busy_s if now >= self._shared_until else 0.0)
        got = _spin(q, tail, head, busy, end, self.spin_yield)
        if got == 2 and now > self._core_checked + CORE_CHECK_S:
            self._core_checked = now
            if _same_core(self._peer_pid):
                self._shared_until = now + SHARED_CORE_S    # keeping the core only delays the peer
        if got:
            return True
        while True:
            if self._closed:
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
            for fd, ev in events:
                if fd == self._data_in:
                    _drain(fd)
                elif not self._closed:
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
            pos = self._head % RING_BYTES
            rec_len, kind = REC_HEAD.unpack_from(ring, pos)          # positions are 8-aligned: always fits
            if kind == KIND_WRAP:
                if pos + rec_len != RING_BYTES:
                    raise ProtocolError("shm: wrap marker does not reach the end of the ring")
                self._head += rec_len
                continue
            if rec_len % 8 or rec_len < REC.size or pos + rec_len > RING_BYTES:
                raise ProtocolError(f"shm: record length {rec_len} at ring offset {pos}")
            if kind != KIND_FRAME or rec_len > RECORD_MAX:
                raise ProtocolError(f"shm: record kind {kind}, length {rec_len}")
            return (pos, *REC.unpack_from(ring, pos))

    def _recv(self, limits: Limits, pool: BufferPool, into: Into | None) -> Frame:
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
        targets = into(msg_kind, seq, list(lengths)) if (into is not None and lengths) else None
        if targets is not None:
            targets = [as_bytes_view(v) for v in targets]
            if [v.nbytes for v in targets] != list(lengths):
                targets = None  # not the reply the caller prepared for (an error, say)
        bufs = []
        for i, n in enumerate(lengths):
            if targets is not None:
                dest = targets[i]
                dest[:] = ring[p:p + n]
            else:
                dest = memoryview(bytearray(ring[p:p + n]))   # small: a fresh copy is cheaper than a lease
            bufs.append(dest)
            p += n
        self._consume(rec_len)
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
        self._head += rec_len
        q[self._head_in] = self._head
        _fence()
        if q[self._waiting_in]:
            os.eventfd_write(self._space_in, 1)

    def _release_slot(self, slot: int) -> None:
        if self._closed:
            return
        try:
            self._slots_in[slot] = 0
            _fence()
            if self._q[self._waiting_in]:
                os.eventfd_write(self._space_in, 1)
        except (OSError, ValueError):
            pass  # closing under us: nothing waits for this slot any more

    # ---- closing -------------------------------------------------------------------

    def _lost(self, exc: BaseException, where: str):
        if isinstance(exc, (ConnectionLost, ProtocolError)):
            return exc
        if self._closed:
            return ConnectionLost("connection closed")
        return ConnectionLost(f"shm {where}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes our own waiters and tells the peer
        except OSError:
            pass
        # Release memory and descriptors only once no thread is inside send or receive:
        # an fd closed under a poll could be reused by an unrelated open.
        got_send = self._send_lock.acquire(timeout=2)
        got_recv = self._recv_lock.acquire(timeout=2)
        try:
            if got_send and got_recv:
                self._release_resources()
        finally:
            if got_recv:
                self._recv_lock.release()
            if got_send:
                self._send_lock.release()

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
    """(prefix, views) of each frame in ``parts``: this transport's frames, or plain prefix + buffer parts."""
    i, n = 0, len(parts)
    while i < n:
        part = parts[i]
        if type(part) is _Out:
            yield part.prefix, part.views
            i += 1
            continue
        prefix = bytes(part)
        if prefix[:4] != MAGIC:
            raise TypeError("shm sends whole frames: build the parts with frame_parts")
        nbufs = HEADER.unpack_from(prefix)[7]
        yield prefix, [as_bytes_view(v) for v in parts[i + 1:i + 1 + nbufs]]
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


def recv_fds(sock: socket.socket, size: int, maxfds: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """``socket.recv_fds`` with its flags honoured (3.11's drops them)."""
    msg, ancdata, _, _ = sock.recvmsg(size, socket.CMSG_LEN(maxfds * 4), flags)
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def _drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except (BlockingIOError, InterruptedError):
        pass
