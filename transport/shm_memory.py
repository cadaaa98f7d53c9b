"""Shared memory under the shm transport: sealed memfd segments and the sender's heap of big buffers.

A ``Segment`` is one memfd, sealed so that it can neither shrink nor grow (a
peer that truncated it could make our next access fault) and mapped read-write.
Nothing is ever named in /dev/shm: the memory goes away with the last fd and
mapping. The ``Heap`` is one sending side's memory for buffers too big for the
ring: first fit over its segments, one *slot* per frame in a table shared with
the receiver (1 while the receiver may still read the frame's buffers, cleared
by the receiver when it lets go), a new segment announced to the peer when
nothing fits, and idle segments beyond ``keep`` bytes handed back. ``PeerSegments``
is the receiving side's counterpart: the peer's segments mapped here, as the Unix
socket announces and drops them.
"""
from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import socket
from typing import Callable

import numpy as np

from rgpu.errors import ProtocolError

from .shm_ring import CTL_MSG, OP_DROP, OP_SEGMENT, recv_fds

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
ALIGN = 4096
GROW_STEP = 2 << 20
HUGE = 2 << 20


def round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


class Segment:
    """One sealed memfd mapped here, owning its mapping; ``fd`` is kept only until it has been passed to the peer."""

    __slots__ = ("id", "size", "fd", "mm", "array")

    def __init__(self, seg_id: int, fd: int, size: int):
        self.id, self.size, self.fd = seg_id, size, fd
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:   # 2 MiB pages where shmem THP is "advise": fewer TLB misses copying and reading
                self.mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    @classmethod
    def create(cls, seg_id: int, size: int, name: str = "rgpu-shm") -> "Segment":
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(seg_id, fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, seg_id: int, fd: int, size: int, max_size: int) -> "Segment":
        """Map a segment the peer sent; refuse one of another size or one that could still shrink."""
        try:
            if not 0 < size <= max_size:
                raise ProtocolError(f"shm: segment {seg_id} of {size} bytes is outside 1..{max_size}")
            if os.fstat(fd).st_size != size:
                raise ProtocolError(f"shm: segment {seg_id} is not the {size} bytes announced")
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise ProtocolError(f"shm: segment {seg_id} is not sealed against shrinking")
            seg = cls(seg_id, fd, size)
        except OSError as exc:
            os.close(fd)
            raise ProtocolError(f"shm: cannot map segment {seg_id}: {exc}") from None
        except BaseException:
            os.close(fd)
            raise
        seg.close_fd()
        return seg

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def view(self, off: int, n: int) -> memoryview:
        return memoryview(self.array[off:off + n])

    def close(self) -> None:
        """Unmap now, or (when views handed out still hold it) when the last of them goes."""
        self.close_fd()
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass


class Heap:
    """The sender's memory for big buffers: first fit over segments, one slot per frame in flight.

    Owns its segments, their free runs, the free slots, each slot's places in flight and the buffers it
    names but does not copy (``hold``). Given the slot table shared with the receiver (``slots``: it
    sets a slot, the receiver clears it) and how to announce a new segment to the peer and drop one."""

    def __init__(self, slots: memoryview, announce: Callable[[Segment], None], drop: Callable[[int], None],
                 first_bytes: int = 64 << 20, cap_bytes: int = 8 << 30, keep_bytes: int = 512 << 20):
        self.slots = slots                       # shared table: 1 = the receiver holds the frame
        self._announce, self._drop = announce, drop
        self.first_bytes, self.cap_bytes, self.keep_bytes = first_bytes, cap_bytes, keep_bytes
        self.segments: dict[int, Segment] = {}
        self._free: dict[int, list[list[int]]] = {}     # segment id -> sorted [offset, length] runs
        self._free_slots = list(range(len(slots) - 1, -1, -1))
        self._inflight: dict[int, list[tuple[int, int, int]]] = {}
        self._held: dict[int, list] = {}        # slot -> buffers named, not copied: kept alive until it clears
        self._next_id = 1
        self.total = 0

    # ---- allocation ----------------------------------------------------------------

    def alloc(self, sizes: list[int]) -> tuple[int, list[tuple[int, int]]] | None:
        """(slot, [(segment id, offset)]) for a frame's buffers, or None until the receiver lets go of some."""
        self.reap()   # first, so that the lowest (warm, already faulted-in) memory is used again
        if not self._free_slots:
            return None
        places: list[tuple[int, int, int]] = []
        for n in sizes:
            n = round_up(max(n, 1), ALIGN)
            where = self._take(n)
            if where is None:
                where = self._grow(n)
            if where is None:
                for sid, off, m in places:
                    self._give(sid, off, m)
                return None
            places.append((where[0], where[1], n))
        slot = self._free_slots.pop()
        self.slots[slot] = 1
        self._inflight[slot] = places
        return slot, [(sid, off) for sid, off, _ in places]

    def view(self, seg_id: int, off: int, n: int) -> memoryview:
        return self.segments[seg_id].view(off, n)

    def new_id(self) -> int:
        """A segment id the peer has not seen (heap segments and shared regions draw from one count)."""
        self._next_id += 1
        return self._next_id - 1

    def reap(self) -> bool:
        """Take back what the receiver has let go of; True when anything came back."""
        done = [s for s in self._inflight if self.slots[s] == 0]
        for slot in done:
            for sid, off, n in self._inflight.pop(slot):
                self._give(sid, off, n)
            self._held.pop(slot, None)
            self._free_slots.append(slot)
        if done and self.total > self.keep_bytes:
            self._trim()
        return bool(done)

    def hold(self, slot: int, buffers: list) -> None:
        """Keep ``buffers`` (the sender's own memory, named in the frame) alive until the receiver lets go.

        Why: a pinned tensor dropped right after a non-blocking upload would give its block
        back to the pinned allocator, whose next tensor could overwrite it before the peer has
        read it (CUDA's caching host allocator waits on an event for the same reason).
        """
        self._held[slot] = buffers

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def _take(self, n: int) -> tuple[int, int] | None:
        for sid, runs in self._free.items():
            for run in runs:
                if run[1] >= n:
                    off = run[0]
                    run[0] += n
                    run[1] -= n
                    if run[1] == 0:
                        runs.remove(run)
                    return sid, off
        return None

    def _give(self, sid: int, off: int, n: int) -> None:
        runs = self._free.get(sid)
        if runs is None:
            return
        i = bisect.bisect_left(runs, [off, 0])
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == off:      # joins the run before
            runs[i - 1][1] += n
            i -= 1
        else:
            runs.insert(i, [off, n])
        if i + 1 < len(runs) and runs[i][0] + runs[i][1] == runs[i + 1][0]:  # and the run after
            runs[i][1] += runs[i + 1][1]
            del runs[i + 1]

    def _grow(self, n: int) -> tuple[int, int] | None:
        size = max(round_up(n, GROW_STEP), self.first_bytes if not self.segments else self.total)
        if self.total + size > self.cap_bytes:
            if self._inflight:
                return None                           # wait for the receiver rather than grow past the cap
            size = round_up(n, GROW_STEP)
        seg = Segment.create(self.new_id(), size, "rgpu-shm-heap")
        try:
            self._announce(seg)
        except BaseException:
            seg.close()
            raise
        seg.close_fd()
        self.segments[seg.id] = seg
        self._free[seg.id] = [[n, size - n]] if size > n else []
        self.total += size
        return seg.id, 0

    def _trim(self) -> None:
        """Hand back wholly idle segments (newest first) while more than ``keep_bytes`` are mapped."""
        for sid in sorted(self.segments, reverse=True):
            seg = self.segments[sid]
            if self.total <= self.keep_bytes or len(self.segments) == 1:
                return
            if self._free[sid] == [[0, seg.size]]:
                self._drop(sid)
                del self.segments[sid], self._free[sid]
                self.total -= seg.size
                seg.close()

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        self._free.clear()
        self._held.clear()


class PeerSegments:
    """The peer's segments mapped here (its heap's, and regions it names), by id, and whether it is gone:
    state this object owns, kept as the peer says on the Unix socket (``service``). Given the socket
    and the biggest segment it may map."""

    def __init__(self, sock: socket.socket, max_segment: int):
        self._sock, self._max_segment = sock, max_segment
        self.mapped: dict[int, Segment] = {}
        self.gone = False                  # the socket said end of file: the peer closed or died

    def service(self, block: bool = False) -> None:
        """Read what the peer said on the Unix socket: new heap segments, dropped ones, or its end."""
        while not self.gone:
            try:
                msg, fds = recv_fds(self._sock, CTL_MSG.size, 4, 0 if block else socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionResetError:
                msg, fds = b"", []
            if not msg:
                self.gone = True
                for fd in fds:
                    os.close(fd)
                return
            if len(msg) != CTL_MSG.size:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"shm: control message of {len(msg)} bytes")
            op, seg_id, size = CTL_MSG.unpack(msg)
            if op == OP_SEGMENT and len(fds) == 1 and seg_id not in self.mapped:
                self.mapped[seg_id] = Segment.attach(seg_id, fds[0], size, self._max_segment)
            elif op == OP_DROP and not fds and seg_id in self.mapped:
                self.mapped.pop(seg_id).close()
            else:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"shm: bad control message (op {op}, segment {seg_id}, {len(fds)} fds)")
            if block:
                return

    def segment(self, seg_id: int) -> Segment:
        """Segment ``seg_id`` (``ProtocolError`` when the peer never announced it)."""
        seg = self.mapped.get(seg_id)
        if seg is None:
            self.service()      # announced before the record that uses it: already queued
            seg = self.mapped.get(seg_id)
        if seg is None:
            raise ProtocolError(f"shm: record names segment {seg_id}, never announced")
        return seg

    def close(self) -> None:
        for seg in self.mapped.values():
            seg.close()
        self.mapped.clear()
