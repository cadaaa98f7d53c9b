"""Tensors' bytes between this process and the server: uploads in pieces, downloads, pinned memory by name.

Big uploads go in pieces, so that ops interleave and the server's copies to the
GPU overlap the next piece's arrival. Over shm, pinned memory (``pinned.cpp``:
memfd blocks) is not copied at all: the transport names it (``share_memory``), the
server maps it and its GPU reads or writes it by DMA. A big download into
ordinary memory goes through two pinned stages the server fills in turn while
we copy out of the other. Measured on the GPU host: ``docs/perf/transport.md``.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from rgpu.protocol.ops import Msg
from rgpu.transport import fastcopy, wire
from rgpu.transport.wire import as_bytes_view

UPLOAD_PIECE_BYTES = 8 << 20  # bigger uploads go in pieces of this size (to a contiguous destination)
# over tcp, where a piece is neither copied here nor kept as a copy (held): each one's cost is the frame's
# own (the streams' threads woken on both ends, an acknowledgement), so fewer, bigger ones go faster;
# an op waits behind one at most this long (2 ms at the GPU host's 9 GB/s over 4 streams)
TCP_PIECE_BYTES = 16 << 20
SHARED_MIN_BYTES = 16 << 10   # what the shm transport sends by naming it, when in pinned memory (its INLINE_MAX)
# Pinned memory over shm is not copied here, so a piece only bounds how long an op waits behind it; the
# server's DMA per piece has a fixed cost, so bigger pieces go faster (docs/perf/fast_path-history.md, uploads)
SHARED_PIECE_BYTES = 64 << 20
STAGED_DOWNLOAD_BYTES = 8 << 20   # downloads over shm from this size go through pinned stages
SHM_PIECE_BYTES = 32 << 20    # other memory over shm: copied into the ring's heap, faster in these than in 8 MiB


class Transfers:
    """One server's uploads and downloads (``s``: its ``servers.Server``, whose lock, connection and events they use)."""

    def __init__(self, s):
        self.s = s
        self._stages: list | None = None   # two pinned blocks big downloads pass through (over shm)
        self._stage_lock = threading.Lock()
        transport = s.conn.transport
        if transport.capabilities.names_shared_memory and hasattr(s.C, "pinned_region"):
            transport.share_memory(_region_finder(s.C))   # pinned memory moves by name over shm

    def upload(self, desc, data, non_blocking: bool = False) -> None:
        view = as_bytes_view(data)
        shared = self.shared(data)
        piece = self.piece_bytes(shared)
        if view.nbytes <= piece or not _contiguous(desc[3], desc[4]):
            with self.s.lock:
                self.s.conn.post([Msg.UPLOAD, self.s.events(), desc], [view])
        else:
            # in pieces, the lock let go between them: other threads' ops never wait for the whole upload,
            # and the server copies each piece to the device while the next one arrives
            held = not shared and self.s.conn.transport.capabilities.resumable
            if held:
                # a resumable session's replay log copies a posted buffer (the caller may change it once
                # post() returns): into fresh memory, a page fault per 4 KiB, costlier than the send (the
                # GPU host's gVisor). Held, the pieces are kept by reference, and the last one is a request:
                # its answer says the server has them all, so nothing replays the caller's memory after we
                # return (unless non_blocking from pinned memory: as on CUDA, left alone until a synchronize)
                view = wire.held(view)
            last = view.nbytes - (view.nbytes - 1) % piece - 1
            wait = held and not (non_blocking and _pinned(data))
            for offset in range(0, view.nbytes, piece):
                with self.s.lock:
                    meta, part = [Msg.UPLOAD_PART, self.s.events(), desc, offset], [view[offset:offset + piece]]
                    if not (wait and offset == last):
                        self.s.conn.post(meta, part)
                        continue
                    fut = self.s.conn.request(meta, part)
                fut.result().release()
        if shared and not non_blocking:
            # sent by naming the pinned memory, not copied: as CUDA's copy from pinned memory, a
            # blocking one returns once the device has the bytes, so the caller may change them then
            self.s.request([Msg.SYNC])
            self._settle()

    def _settle(self) -> None:
        """The server is done with what we named: the transport may let go of it (its blocks can be reused)."""
        self.s.conn.transport.settle()

    def piece_bytes(self, shared: bool = False) -> int:
        """The size of an upload's pieces: named pinned memory, other memory over shm, tcp, else."""
        if shared:
            return SHARED_PIECE_BYTES
        return {"shm": SHM_PIECE_BYTES, "tcp": TCP_PIECE_BYTES}.get(self.s.conn.transport_name, UPLOAD_PIECE_BYTES)

    def shared(self, data) -> bool:
        """Whether the transport will name ``data`` (a tensor or bytes-like) rather than copy it: pinned, over shm."""
        transport = self.s.conn.transport
        if (not transport.capabilities.names_shared_memory
                or data.nbytes <= max(SHARED_MIN_BYTES, self.s.conn.settings.post_copy_bytes)):
            return False   # (buffers a post copies at once never reach the transport as they are)
        addr = data.data_ptr() if isinstance(data, torch.Tensor) else np.frombuffer(data, np.uint8).ctypes.data
        return transport.names(addr, data.nbytes)

    def download(self, desc, into: memoryview) -> None:
        contiguous = _contiguous(desc[3], desc[4])
        if contiguous and self.shared(into):
            self._fill(desc, 0, into).result().release()   # pinned: the server writes into it in place
            self._settle()
            return
        if contiguous and into.nbytes >= STAGED_DOWNLOAD_BYTES:
            with self._stage_lock:         # (the stages are made once, and one download uses them at a time)
                if self._download_stages():
                    self._download_staged(desc, into)
                    return
        with self.s.lock:
            fut = self.s.conn.request([Msg.DOWNLOAD, self.s.events(), desc], reply_into=[into])
        reply = fut.result()
        try:
            got = reply.buffers[0]
            if got.nbytes != into.nbytes:
                raise RuntimeError(f"rgpu: expected {into.nbytes} bytes from the server, got {got.nbytes}")
            if got is not into:
                into[:] = got
        finally:
            reply.release()

    def _fill(self, desc, offset: int, into):
        """Ask the server to write bytes ``offset``.. of ``desc`` into ``into``, shared memory it maps."""
        with self.s.lock:
            fut = self.s.conn.request([Msg.DOWNLOAD, self.s.events(), desc, offset], [into])
            # what the connection counted as sent is the server's reply, written in place: rgpu.stats() says so
            stats, n = self.s.conn.stats, memoryview(into).nbytes
            stats["bytes_out"] -= n
            stats["bytes_in"] += n
        return fut

    def _download_stages(self) -> bool:
        """Whether big downloads can go through pinned stages the server fills in place (made on first use)."""
        if self._stages is None:
            self._stages = []
            if self.s.conn.transport.capabilities.names_shared_memory:
                # .pin_memory(), not empty(pin_memory=True): where CUDA is there too, the latter takes CUDA's allocator
                stages = [torch.empty(SHARED_PIECE_BYTES + STAGED_DOWNLOAD_BYTES, dtype=torch.uint8).pin_memory()
                          for _ in range(2)]
                if all(self.shared(st) for st in stages):   # (memfd blocks: not where pinning is plain memory)
                    self._stages = stages
        return bool(self._stages)

    def _download_staged(self, desc, into: memoryview) -> None:
        """A big download over shm through two pinned stages: the GPU fills one while we copy out of the other.

        Why: the server's GPU writes a pinned stage by DMA and we copy it once into
        ``into`` (ordinary memory: ``.cpu()``'s result), where the plain path copies
        three times (to the server's memory, its ring heap, then here).
        """
        piece = SHARED_PIECE_BYTES
        stages = [memoryview(st.numpy()) for st in self._stages]
        n = into.nbytes
        # pieces of `piece` bytes; a short tail joins the last piece, so that each one is big enough to be named
        starts = list(range(0, n, piece))
        if len(starts) > 1 and n - starts[-1] < STAGED_DOWNLOAD_BYTES:
            starts.pop()
        bounds = list(zip(starts, starts[1:] + [n]))
        pending: list = []
        for k, (lo, hi) in enumerate(bounds):
            if len(pending) == 2:      # this piece's stage still holds piece k-2: copy that out first
                _copy_out(*pending.pop(0), into)
            pending.append((self._fill(desc, lo, stages[k % 2][:hi - lo]), lo, hi, stages[k % 2]))
        for item in pending:
            _copy_out(*item, into)


def _copy_out(fut, lo: int, hi: int, stage: memoryview, into: memoryview) -> None:
    fut.result().release()
    fastcopy.copy(into[lo:hi], stage[:hi - lo])


def _region_finder(C):
    def find(addr: int, nbytes: int):
        region = C.pinned_region(addr)
        return tuple(region) if region else None
    return find


def _pinned(data) -> bool:
    try:
        return isinstance(data, torch.Tensor) and data.is_pinned()
    except RuntimeError:   # no accelerator says where it lies
        return False


def _contiguous(sizes, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
