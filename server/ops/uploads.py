"""Uploads: big ones in pieces (``Msg.UPLOAD_PART``) landing at their offsets, whole ones through a pinned ring.

Why pieces: a gigabyte sent as one frame holds every small op behind it until the
last byte is in, and the copy to the GPU could only start then. In pieces (16 MiB
over tcp), ops interleave with them. On a GPU a piece is received into a pinned
block (``ReceivePool``, the frame loop's pool) and goes to the device from there
asynchronously while the next one is received; one that arrived elsewhere goes
through a pinned staging slot: copied there on the host, then to the device.
Over shm a piece arrives in place, in a memfd segment the client made and this
process mapped, and goes to the GPU by DMA straight from it (``Pinned``).

A whole upload (``Msg.UPLOAD``: a training step's batch) goes through a ``Ring`` on
a GPU: copied into pinned memory here, then to the device asynchronously. An upload
bigger than the ring goes through the slots; a strided destination, or a ring that
would not pin, is copied plainly. The pinned memory itself (registrations, slots,
the ring) is ``staging.py``.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from .handles import HandleTable, Poisoned
from .staging import SLOT_BYTES, Pinned, Readback, ReceivePool, Ring, Slot, pin, unpin

log = logging.getLogger("rgpu.server.uploads")

SLOTS = 3                 # staging slots: one being filled, one crossing PCIe, one spare


class UploadError(Exception):
    """A piece this server will not take; ``op`` names the message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.op = "upload"


class Uploads:
    """The session's uploads (pinned staging slots made on the first piece, a ring on a GPU's first whole one)."""

    def __init__(self, table: HandleTable, on_gpu: bool):
        self.table, self.on_gpu = table, on_gpu
        self.slots: list[Slot] = []
        self.next = 0
        self.pinned = Pinned()
        self.rings: dict[int, Ring | None] = {}  # by GPU; None where it would not pin
        self.ring_failed = False
        self.readback = Readback()             # downloads' answers (pinned on the first one)
        # on a GPU, the frame loop receives big buffers into pinned blocks (the worker asks the executor)
        self.receive_pool = ReceivePool() if on_gpu else None
        # how pieces went (UPLOAD_INFO): each way, by DMA from or to shm segments, staged, or on the CPU;
        # and whole uploads to a GPU: through the ring, through the slots (bigger than it), or plainly
        self.pieces = {"cpu": 0, "dma from shm": 0, "staged": 0, "dma to shm": 0, "to host memory": 0,
                       "whole by ring": 0, "whole staged": 0, "whole plain": 0, "download kept": 0,
                       "dma from received": 0}

    def info(self, meta, buffers):
        """``Msg.UPLOAD_INFO``: ``({"pieces": counts by way, "registered_bytes", "slots_pinned",
        "register_failed", "ring_bytes"}, [])``, what the session's uploads went through (tests, benchmarks)."""
        rings = [r for r in self.rings.values() if r is not None]
        return {"pieces": dict(self.pieces, **{"ring full": sum(r.waits for r in rings)}),
                "registered_bytes": sum(r.nbytes for r in self.pinned.entries.values()),
                "slots_pinned": sum(s.registered for s in self.slots), "register_failed": self.pinned.failed,
                "ring_bytes": sum(r.bytes.nbytes for r in rings)}, []

    def close(self) -> None:
        """The session ends: staged copies finished (the GPU synchronised), then every pinned registration undone."""
        received = self.receive_pool is not None and self.receive_pool.blocks
        if self.pinned.entries or self.slots or self.rings or self.readback.host is not None or received:
            torch.cuda.synchronize()  # no copy reads what is unregistered next
            self.pinned.close()
            self.readback.close()
            if received:
                self.receive_pool.close()
            for slot in self.slots:
                if slot.registered:
                    unpin(slot.host.data_ptr())
            self.slots = []
            for index, ring in self.rings.items():
                if ring is not None:
                    ring.drain()  # its GPU may not be the current one, which is all synchronize() waits for
                    with torch.cuda.device(index):
                        unpin(ring.host.data_ptr())
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
        """``Msg.UPLOAD_PART`` ``[events, descriptor, byte offset]`` and one buffer: the piece's bytes at their
        offset of the tensor (a failed op's result is replaced); ``UploadError`` for a piece that does not fit
        its contiguous tensor, or a malformed message. Returns None (a post)."""
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
        received = self.receive_pool.holds(buffers[0]) if self.receive_pool is not None else None
        if received is not None:
            # it arrived in a pinned block: to the device by DMA from there, asynchronously; the block is
            # leased again only once this copy is done
            into.copy_(received, non_blocking=True)
            self.receive_pool.reading(buffers[0], torch.cuda.current_stream(into.device))
            self.pieces["dma from received"] += 1
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

    def answer(self, t: torch.Tensor) -> memoryview | None:
        """A download's bytes (``Msg.DOWNLOAD`` of a GPU tensor) in the kept pinned buffer, copied there
        by DMA (``staging.Readback``: fresh memory per answer cost a page fault per 4 KiB); valid until
        the next download. None where it does not apply: a CPU or strided tensor, or a size outside the
        buffer's bounds (the caller copies it plainly)."""
        if not self.on_gpu or t.device.type != "cuda" or not t.is_contiguous():
            return None
        n = t.numel() * t.element_size()
        if not Readback.takes(n):
            return None   # before the device's context: a small read (.item(), .cpu() of a loss) pays no switch
        with torch.cuda.device(t.device):   # registered (once) in the context of the GPU that writes it
            host = self.readback.view(n)
        if host is None:
            return None
        host.copy_(t.detach().reshape(-1).view(torch.uint8))   # on its stream, after what came before; waited for
        self.pieces["download kept"] += 1
        return memoryview(host.numpy())

    def _staged(self, into: torch.Tensor, src: torch.Tensor) -> None:
        if not self.slots:
            self.slots = [Slot() for _ in range(SLOTS)]
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
