"""Big uploads in pieces (``Msg.UPLOAD_PART``): each piece lands at its byte offset as it arrives.

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
"""
from __future__ import annotations

import logging
import mmap
import sys

import numpy as np
import torch

from .handles import HandleTable, Poisoned

log = logging.getLogger("rgpu.server.uploads")

SLOTS = 3                 # staging slots: one being filled, one crossing PCIe, one spare
SLOT_BYTES = 8 << 20      # the client's largest piece


class UploadError(Exception):
    """A piece this server will not take; ``op`` names the message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.op = "upload"


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
            rc = int(torch.cuda.cudart().cudaHostRegister(base, root.nbytes, 0))
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
        rc = int(torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), SLOT_BYTES, 0))
        self.registered = rc == 0
        if not self.registered:
            log.warning("cudaHostRegister of a staging slot failed (%d): its copies run at pageable speed", rc)
        self.done: torch.cuda.Event | None = None


class Uploads:
    """The session's piecewise uploads (pinned staging slots made on the first piece, on a GPU)."""

    def __init__(self, table: HandleTable, on_gpu: bool):
        self.table, self.on_gpu = table, on_gpu
        self.slots: list[_Slot] = []
        self.next = 0
        self.pinned = Pinned()
        # how pieces went (UPLOAD_INFO): each way, by DMA from or to shm segments, staged, or on the CPU
        self.pieces = {"cpu": 0, "dma from shm": 0, "staged": 0, "dma to shm": 0, "to host memory": 0}

    def info(self, meta, buffers):
        return {"pieces": dict(self.pieces), "registered_bytes": sum(r.nbytes for r in self.pinned.entries.values()),
                "slots_pinned": sum(s.registered for s in self.slots), "register_failed": self.pinned.failed}, []

    def close(self) -> None:
        if self.pinned.entries or self.slots:
            torch.cuda.synchronize()
            self.pinned.close()
            for slot in self.slots:
                if slot.registered:
                    torch.cuda.cudart().cudaHostUnregister(slot.host.data_ptr())
            self.slots = []

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
            slot.done.record()
