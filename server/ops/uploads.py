"""Uploads: big ones in pieces (``Msg.UPLOAD_PART``) landing at their offsets, whole ones through a pinned ring.

Why pieces: a gigabyte sent as one frame holds every small op behind it until the
last byte is in, and the copy to the GPU could only start then. In pieces of at
most 8 MiB, ops interleave with them, and on a GPU each piece goes through a
pinned staging slot: copied there on the host, then to the device asynchronously,
so the next piece is received and staged while the previous one crosses PCIe.

Over shm a piece arrives in place, in a memfd segment the client made and this
process mapped: ``Pinned`` registers each such segment with ``cudaHostRegister``
once and the piece goes to the GPU by DMA straight from it, no staging copy. The
frame's memory goes back to the client when ``handle`` returns, so that copy
finishes first; the pipeline is the client writing piece k+1 into its segment
while this side's DMA moves piece k. A registration ends (``cudaHostUnregister``)
once the transport has let its segment go, before the mapping can be unmapped.

A whole upload (``Msg.UPLOAD``: a training step's batch) copied to the GPU from the
frame's pageable memory would hold this thread until the GPU had finished all it
was given before. On a GPU it goes through a ``Ring`` instead: copied into pinned
memory here, then to the device asynchronously on the current stream, where later
ops run after it. Each copy records an event; a span of the ring is reused once the
event of the copy that last read it is done, so an upload waits for the GPU only
when the ring is full of pending copies. An upload bigger than the ring goes
through the slots; a strided destination, or a ring that would not pin, is copied
plainly.
"""
from __future__ import annotations

import logging
import mmap
import sys
from collections import deque

import numpy as np
import torch

from .handles import HandleTable, Poisoned

log = logging.getLogger("rgpu.server.uploads")

SLOTS = 3                 # staging slots: one being filled, one crossing PCIe, one spare
SLOT_BYTES = 8 << 20      # the client's largest piece
RING_BYTES = 4 << 20      # whole uploads' staging, per GPU: a step's batch (2 x 128 KiB) many times over
RING_ALIGN = 256          # each upload's span starts at a multiple of this


class UploadError(Exception):
    """A piece this server will not take; ``op`` names the message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.op = "upload"


def pin(ptr: int, nbytes: int) -> int:
    """``cudaHostRegister`` of host memory, in the current GPU's context; its error code (0: pinned).

    A failure is also CUDA's "last error", which torch's next kernel-launch check would raise as that
    op's failure (a session's next op failing with "memory range is already mapped"): it is read away
    here by a launch whose check consumes it.
    """
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if rc != 0:
        try:
            torch.zeros(1, device="cuda")
        except (RuntimeError, AssertionError):   # the stale error itself; or no CUDA (a test's stand-in)
            pass
    return rc


class Pinned:
    """Host mappings registered with CUDA, by base address; each entry holds its root array (the mapping)."""

    def __init__(self):
        self.entries: dict[int, np.ndarray] = {}
        self.failed = False

    def view(self, buf: memoryview) -> torch.Tensor | None:
        """``buf`` as a CPU tensor the GPU reads by DMA, when it lies in a registrable mapping; else None."""
        if self.failed:
            return None
        root = buf.obj
        while isinstance(root, np.ndarray) and isinstance(root.base, np.ndarray):
            root = root.base
        mapping = root.base.obj if isinstance(root, np.ndarray) and isinstance(root.base, memoryview) else None
        if not isinstance(mapping, mmap.mmap):
            return None  # not a segment mapping (tcp: pool memory)
        base = root.ctypes.data
        if base not in self.entries:
            self.forget_dropped()
            rc = pin(base, root.nbytes)
            if rc != 0:
                self.failed = True
                log.warning("cudaHostRegister of a shm segment failed (%d); uploads staged instead", rc)
                return None
            self.entries[base] = root
        return torch.frombuffer(buf, dtype=torch.uint8)

    def forget_dropped(self) -> None:
        """Unregister mappings only we still hold (the transport let the segment go); then they unmap."""
        for base in list(self.entries):
            if sys.getrefcount(self.entries[base]) <= 2:  # the dict's and getrefcount's argument
                torch.cuda.cudart().cudaHostUnregister(base)
                del self.entries[base]

    def close(self) -> None:
        for base in list(self.entries):
            torch.cuda.cudart().cudaHostUnregister(base)
        self.entries.clear()


class _Slot:
    __slots__ = ("host", "done", "registered")

    def __init__(self):
        # pinned by registering it with CUDA ourselves: with rgpu imported, torch's current accelerator
        # is rgpu, and pin_memory=True does not give CUDA pinned memory
        self.host = torch.empty(SLOT_BYTES, dtype=torch.uint8)
        rc = pin(self.host.data_ptr(), SLOT_BYTES)
        self.registered = rc == 0
        if not self.registered:
            log.warning("cudaHostRegister of a staging slot failed (%d): its copies run at pageable speed", rc)
        self.done: torch.cuda.Event | None = None


def _send(dst: torch.Tensor, host: torch.Tensor, done) -> None:
    dst.copy_(host, non_blocking=True)  # on dst's device's current stream, where later ops run after it
    done.record(torch.cuda.current_stream(dst.device))  # that device's stream, not the current device's


class Ring:
    """Pinned staging for whole uploads, handed out front to back; a span is reused only once the copy that
    last read it is done.

    ``event()`` makes the marks recorded after each copy (``torch.cuda.Event``: ``query``, ``synchronize``);
    ``send(dst, host, done)`` queues the copy of ``host`` into ``dst`` and records ``done`` after it. Both
    can be swapped, so the bookkeeping runs without a GPU. The caller pins ``host`` (``cudaHostRegister``).
    """

    def __init__(self, nbytes: int = RING_BYTES, event=torch.cuda.Event, send=_send):
        # a mapping of its own: page-aligned, so its registration shares no page with another one
        self.mapping = mmap.mmap(-1, nbytes)
        self.host = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.bytes = self.host.numpy()
        self.event, self.send = event, send
        self.head = 0                   # where the next span may start, in bytes handed out since the start
        self.pending: deque = deque()   # (start, event) of copies that may still read their span, oldest first
        self.spare: list = []           # events of finished copies, recorded again rather than made anew
        self.waits = 0                  # times the ring was full of pending copies and waited for the oldest

    def put(self, dst: torch.Tensor, data: memoryview) -> bool:
        """``data`` copied into the ring now, then to ``dst`` (its bytes) asynchronously; False when too big."""
        n, size = data.nbytes, self.bytes.nbytes
        if n > size:
            return False
        start = -(-self.head // RING_ALIGN) * RING_ALIGN
        if start % size + n > size:  # a span never wraps: the ring's end is skipped
            start += size - start % size
        # positions only grow, so the span overlaps a pending copy's exactly when it reaches a ring's
        # length past the oldest one's start; finished copies are retired only when the space is needed
        while self.pending and start + n - self.pending[0][0] > size:
            done = self.pending.popleft()[1]
            if not done.query():
                done.synchronize()  # full of pending copies: wait for the oldest (rare)
                self.waits += 1
            self.spare.append(done)
        at = start % size
        np.copyto(self.bytes[at:at + n], np.frombuffer(data, dtype=np.uint8))  # out of the frame before it goes back
        done = self.spare.pop() if self.spare else self.event()
        self.send(dst, self.host[at:at + n], done)
        self.pending.append((start, done))
        self.head = start + n
        return True

    def drain(self) -> None:
        """Waits for every pending copy: nothing reads the ring after this."""
        while self.pending:
            self.pending.popleft()[1].synchronize()


class Uploads:
    """The session's uploads (pinned staging slots made on the first piece, a ring on a GPU's first whole one)."""

    def __init__(self, table: HandleTable, on_gpu: bool):
        self.table, self.on_gpu = table, on_gpu
        self.slots: list[_Slot] = []
        self.next = 0
        self.pinned = Pinned()
        self.rings: dict[int, Ring | None] = {}  # by GPU; None where it would not pin
        self.ring_failed = False
        # how pieces went (UPLOAD_INFO): each way, by DMA from or to shm segments, staged, or on the CPU;
        # and whole uploads to a GPU: through the ring, through the slots (bigger than it), or plainly
        self.pieces = {"cpu": 0, "dma from shm": 0, "staged": 0, "dma to shm": 0, "to host memory": 0,
                       "whole by ring": 0, "whole staged": 0, "whole plain": 0}

    def info(self, meta, buffers):
        rings = [r for r in self.rings.values() if r is not None]
        return {"pieces": dict(self.pieces, **{"ring full": sum(r.waits for r in rings)}),
                "registered_bytes": sum(r.nbytes for r in self.pinned.entries.values()),
                "slots_pinned": sum(s.registered for s in self.slots), "register_failed": self.pinned.failed,
                "ring_bytes": sum(r.bytes.nbytes for r in rings)}, []

    def close(self) -> None:
        if self.pinned.entries or self.slots or self.rings:
            torch.cuda.synchronize()  # no copy reads what is unregistered next
            self.pinned.close()
            for slot in self.slots:
                if slot.registered:
                    torch.cuda.cudart().cudaHostUnregister(slot.host.data_ptr())
            self.slots = []
            for index, ring in self.rings.items():
                if ring is not None:
                    ring.drain()  # its GPU may not be the current one, which is all synchronize() waits for
                    with torch.cuda.device(index):
                        torch.cuda.cudart().cudaHostUnregister(ring.host.data_ptr())
            self.rings = {}

    def whole(self, dst: torch.Tensor, buf: memoryview) -> None:
        """A whole upload (``Msg.UPLOAD``) into ``dst``: ``buf`` (the frame's) is copied out before this
        returns; on a GPU the copy to the device is queued on its current stream, after what came before."""
        if dst.is_cuda and dst.is_contiguous() and buf.nbytes == dst.numel() * dst.element_size():
            into = dst.view(-1).view(torch.uint8)
            ring = self._ring(dst.device)
            if ring is not None and ring.put(into, buf):
                self.pieces["whole by ring"] += 1
                return
            if ring is not None:  # bigger than the ring
                self._staged(into, torch.frombuffer(buf, dtype=torch.uint8))
                self.pieces["whole staged"] += 1
                return
        # the CPU executor's, or strided, or no pinned memory: a copy (on a GPU, one that returns once it has
        # the bytes)
        dst.copy_(torch.frombuffer(buf, dtype=torch.uint8).view(dst.dtype).view(dst.shape))
        if dst.is_cuda:
            self.pieces["whole plain"] += 1

    def _ring(self, device: torch.device) -> Ring | None:
        if device.index in self.rings:
            return self.rings[device.index]
        ring = None
        if not self.ring_failed:
            ring = Ring()
            with torch.cuda.device(device):  # registered in the context of the GPU that reads it
                rc = pin(ring.host.data_ptr(), ring.bytes.nbytes)
            if rc != 0:
                # not pinned, a non_blocking copy from it would be no faster, and no GPU is tried again
                log.warning("cudaHostRegister of the upload ring failed (%d); whole uploads copied plainly", rc)
                self.ring_failed, ring = True, None
        self.rings[device.index] = ring
        return ring

    def part(self, meta, buffers):
        _, events, desc, offset = meta
        self.table.apply_events(events)
        if len(buffers) != 1 or type(offset) is not int or offset < 0:
            raise UploadError("UPLOAD_PART: [events, tensor, byte offset] and one buffer")
        try:
            dst = self.table.tensor(desc)
        except Poisoned:  # new bytes replace a failed op's result
            self.table.free(desc[0])
            dst = self.table.tensor(desc)
        n = buffers[0].nbytes
        if not dst.is_contiguous() or offset + n > dst.numel() * dst.element_size():
            raise UploadError(f"upload piece of {n} bytes at {offset} does not fit its (contiguous) tensor")
        if n == 0:
            return None
        into = dst.view(-1).view(torch.uint8)[offset:offset + n]
        if not self.on_gpu or into.device.type != "cuda":
            # one thread: a parallel copy per piece costs a thread-pool barrier per piece, a stall on a busy host
            np.copyto(into.numpy(), np.frombuffer(buffers[0], dtype=np.uint8))
            self.pieces["cpu"] += 1
            return None
        src = torch.frombuffer(buffers[0], dtype=torch.uint8)
        pinned = self.pinned.view(buffers[0])
        if pinned is not None:
            into.copy_(pinned)  # DMA, and finished here: the frame's memory goes back when we return
            self.pieces["dma from shm"] += 1
            return None
        self._staged(into, src)
        self.pieces["staged"] += 1
        return None

    def fill(self, t: torch.Tensor, offset, buf: memoryview) -> None:
        """Bytes ``offset``.. of ``t`` written into ``buf``, the client's own memory (a download over shm).

        Why in place: ``buf`` lies in a pinned block of the client's that this process maps
        (the shm transport named it rather than copying it), so the bytes cross once, by DMA
        from the GPU where that mapping registers, and the client reads them where they land.
        """
        n = buf.nbytes
        if type(offset) is not int or offset < 0 or buf.readonly:
            raise UploadError("DOWNLOAD into memory: [events, tensor, byte offset] and one writable buffer")
        if not t.is_contiguous() or offset + n > t.numel() * t.element_size():
            raise UploadError(f"download of {n} bytes at {offset} is outside its (contiguous) tensor")
        src = t.detach().reshape(-1).view(torch.uint8)[offset:offset + n]
        if src.device.type == "cuda":
            pinned = self.pinned.view(buf)
            (pinned if pinned is not None else torch.frombuffer(buf, dtype=torch.uint8)).copy_(src)
            self.pieces["dma to shm" if pinned is not None else "to host memory"] += 1
            return
        np.copyto(np.frombuffer(buf, dtype=np.uint8), src.numpy())
        self.pieces["cpu"] += 1

    def _staged(self, into: torch.Tensor, src: torch.Tensor) -> None:
        if not self.slots:
            self.slots = [_Slot() for _ in range(SLOTS)]
        for start in range(0, src.numel(), SLOT_BYTES):
            piece = src[start:start + SLOT_BYTES]
            slot = self.slots[self.next]
            self.next = (self.next + 1) % len(self.slots)
            if slot.done is not None:
                slot.done.synchronize()  # its previous piece has left the slot
            host = slot.host[:piece.numel()]
            host.copy_(piece)
            into[start:start + piece.numel()].copy_(host, non_blocking=True)
            slot.done = torch.cuda.Event()
            slot.done.record(torch.cuda.current_stream(into.device))  # the stream the copy went to
