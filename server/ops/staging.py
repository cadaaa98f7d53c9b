"""Pinned host memory the uploads stage through: CUDA registrations, staging slots, the whole uploads' ring;
and the kept buffer downloads are answered from (``Readback``).

Over shm a piece of a big upload arrives in place, in a memfd segment the client
made and this process mapped: ``Pinned`` registers each such segment with
``cudaHostRegister`` once and the piece goes to the GPU by DMA straight from it, no
staging copy. The frame's memory goes back to the client when ``handle`` returns, so
that copy finishes first; the pipeline is the client writing piece k+1 into its
segment while this side's DMA moves piece k. A registration ends
(``cudaHostUnregister``) once the transport has let its segment go, before the
mapping can be unmapped.

A whole upload copied to the GPU from the frame's pageable memory would hold this
thread until the GPU had finished all it was given before. A ``Ring`` copies it into
pinned memory here, then to the device asynchronously on the current stream, where
later ops run after it. Each copy records an event; a span of the ring is reused
once the event of the copy that last read it is done, so an upload waits for the GPU
only when the ring is full of pending copies.
"""
from __future__ import annotations

import logging
import mmap
import sys
from collections import deque

import numpy as np
import torch

from rgpu.transport.wire import BufferPool

log = logging.getLogger("rgpu.server.uploads")

SLOT_BYTES = 8 << 20      # a piece is staged in chunks of this size, a slot each
RING_BYTES = 4 << 20      # whole uploads' staging, per GPU: a step's batch (2 x 128 KiB) many times over
RING_ALIGN = 256          # each upload's span starts at a multiple of this
RECEIVE_BYTES = 16 << 20  # the pinned receive blocks' size: the client's largest piece over tcp
RECEIVE_BLOCKS = 4        # at most this many (one being received into, the rest crossing PCIe)
RECEIVE_MIN_BYTES = 1 << 20    # frames' buffers from this size are received into a pinned block
READBACK_MIN_BYTES = 1 << 20   # downloads from this size are answered from the kept pinned buffer ...
READBACK_MAX_BYTES = 1 << 30   # ... up to this size (bigger ones: fresh memory, as before)


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


def _pinned(owner, host: torch.Tensor, nbytes: int, what: str, instead: str) -> bool:
    """``host`` registered by ``owner.pin``; a failure is said once and sets ``owner.failed`` (it is not tried
    again: ``instead`` says what is done then)."""
    rc = owner.pin(host.data_ptr(), nbytes)
    if rc != 0:
        log.warning("cudaHostRegister of %s failed (%d); %s", what, rc, instead)
        owner.failed = True
    return rc == 0


def unpin(ptr: int) -> None:
    """``cudaHostUnregister`` of what ``pin`` registered at ``ptr`` (its error code is not a session's concern:
    the memory is being let go)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


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
                unpin(base)
                del self.entries[base]

    def close(self) -> None:
        for base in list(self.entries):
            unpin(base)
        self.entries.clear()


class Slot:
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


class ReceivePool(BufferPool):
    """The frame loop's receive buffers, pinned where a piece fits a block: its bytes go to the GPU by DMA
    from where they arrived, no staging copy in between (``Uploads.part``).

    Why: a piece staged through a slot is copied once more on this host, in the frame loop, before the
    next piece is read. A block goes back here when its frame is released, with the event of the copy
    still reading it (``reading``); it is leased again only once that copy is done. Buffers of other
    sizes, and every one once a registration failed, come from the plain pool. ``pin`` and ``event`` can
    be swapped, so the bookkeeping runs without a GPU.
    """

    def __init__(self, pin=pin, event=torch.cuda.Event, unpin=unpin):
        super().__init__()
        self.pin, self.event = pin, event
        self.unpin = unpin
        self.blocks: dict[int, tuple[torch.Tensor, np.ndarray]] = {}   # by address: (tensor, array)
        self.free: deque = deque()     # addresses of blocks not leased, oldest first
        self.pending: dict[int, object] = {}   # address -> the event of the copy that reads it
        self.failed = False
        self.waits = 0                 # leases that waited for a block's copy

    def lease(self, n: int):
        if self.failed or not RECEIVE_MIN_BYTES <= n <= RECEIVE_BYTES:
            return super().lease(n)
        addr = self._block()
        if addr is None:
            return super().lease(n)
        done = self.pending.pop(addr, None)
        if done is not None and not done.query():
            done.synchronize()         # every block still read by a copy: wait for the oldest
            self.waits += 1
        array = self.blocks[addr][1]
        return memoryview(array)[:n], array

    def _block(self) -> int | None:
        if self.free and (len(self.blocks) == RECEIVE_BLOCKS or self._done(self.free[0])):
            return self.free.popleft()
        if len(self.blocks) < RECEIVE_BLOCKS:
            host = torch.empty(RECEIVE_BYTES, dtype=torch.uint8)
            if not _pinned(self, host, RECEIVE_BYTES, "a receive block", "pieces staged instead"):
                return None
            self.blocks[host.data_ptr()] = (host, host.numpy())
            return host.data_ptr()
        return None                    # every block leased (a frame of several big buffers)

    def _done(self, addr: int) -> bool:
        done = self.pending.get(addr)
        return done is None or done.query()

    def release(self, block) -> None:
        addr = block.ctypes.data if isinstance(block, np.ndarray) else None
        if addr in self.blocks and self.blocks[addr][1] is block:
            self.free.append(addr)
        else:
            super().release(block)

    def holds(self, buf: memoryview) -> torch.Tensor | None:
        """``buf`` as a tensor of its pinned block, when it lies in one (else None)."""
        obj = buf.obj
        if type(obj) is not np.ndarray:
            return None
        entry = self.blocks.get(obj.ctypes.data)
        return torch.frombuffer(buf, dtype=torch.uint8) if entry is not None and entry[1] is obj else None

    def reading(self, buf: memoryview, stream) -> None:
        """A copy reading ``buf``'s block was queued on ``stream``: the block is not leased before it is done."""
        done = self.event()
        done.record(stream)
        self.pending[buf.obj.ctypes.data] = done

    def close(self) -> None:
        """Unregistered (the caller synchronised first: no copy reads a block)."""
        for addr in self.blocks:
            self.unpin(addr)
        self.blocks.clear()
        self.free.clear()
        self.pending.clear()


class Readback:
    """Pinned host memory a download's answer is copied into by DMA, kept for the next download.

    Why: ``.to("cpu")`` of a GPU tensor copies into fresh pageable memory, a page fault per 4 KiB (on
    the GPU host's gVisor kernel that, not the copy, set a 1 GiB download's pace) and a copy CUDA stages
    through its own buffers. Kept and registered, the memory faults once, and the GPU writes it by DMA.
    It grows to the largest download (a power of two, at most ``READBACK_MAX_BYTES``) and is given back
    at the session's end. ``pin``/``unpin`` can be swapped, so the bookkeeping runs without a GPU.
    """

    def __init__(self, pin=pin, unpin=unpin):
        self.pin, self.unpin = pin, unpin
        self.host: torch.Tensor | None = None
        self.mapping: mmap.mmap | None = None
        self.failed = False

    @staticmethod
    def takes(nbytes: int) -> bool:
        """Whether a download of ``nbytes`` is one the kept buffer answers (smaller ones are copied plainly)."""
        return READBACK_MIN_BYTES <= nbytes <= READBACK_MAX_BYTES

    def view(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of the kept pinned memory (grown first where it is smaller); None where a download
        that size is not answered from it: outside the bounds, or a registration that failed (once)."""
        if self.failed or not self.takes(nbytes):
            return None
        if self.host is None or self.host.numel() < nbytes:
            self.close()
            size = min(1 << (nbytes - 1).bit_length(), READBACK_MAX_BYTES)
            mapping = mmap.mmap(-1, size)    # page-aligned: its registration shares no page with another
            host = torch.frombuffer(mapping, dtype=torch.uint8)
            if not _pinned(self, host, size, "the download buffer", "downloads copied plainly"):
                return None
            self.host, self.mapping = host, mapping
        return self.host[:nbytes]

    def close(self) -> None:
        """Unregistered (no copy may be reading it: the caller synchronised); unmapped once no view is left."""
        if self.host is not None:
            self.unpin(self.host.data_ptr())
            self.host = self.mapping = None


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
