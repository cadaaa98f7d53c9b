"""The client's session with the server's ops route: started on first use of the device.

Owns the connection, the op index (each op's name and schema sent once, then
an integer), and the allocator's event log that rides along with every
message. ``use()`` swaps in another connection (tests run the executor in-process).
"""
from __future__ import annotations

import atexit
import sys
import threading

import numpy as np
import torch

from rgpu.ops_protocol import Msg

from rgpu.transport import fastcopy
from rgpu.transport.buffers import as_bytes_view

from . import build

UPLOAD_PIECE_BYTES = 8 << 20  # bigger uploads go in pieces of this size (to a contiguous destination)
SHARED_MIN_BYTES = 16 << 10   # what the shm transport sends by naming it, when in pinned memory (its INLINE_MAX)
# Pinned memory over shm is not copied here, so a piece only bounds how long an op waits behind it; the
# server's DMA per piece has a fixed cost (GPU host, 1 GiB: 33 GB/s in 8 MiB pieces, 49 in 64 MiB, 52 whole)
SHARED_PIECE_BYTES = 64 << 20
STAGED_DOWNLOAD_BYTES = 8 << 20   # downloads over shm from this size go through pinned stages
SHM_PIECE_BYTES = 32 << 20    # other memory over shm: copied into the ring's heap at ~19 GB/s in these, 15 in 8 MiB

_lock = threading.RLock()
_session: "Session | None" = None


class Session:
    def __init__(self, conn, C):
        self.conn, self.C = conn, C
        self.lock = threading.RLock()  # ops come from the main thread and autograd's device threads
        self.ops: dict = {}
        w = (conn.welcome or {}).get("info") or {}  # what the ops executor's welcome() said
        self.kind = w.get("device", "cpu")
        self.names = list(w.get("names", ["rgpu"]))
        self.count = int(w.get("device_count", len(self.names)))
        self.server_torch = w.get("torch")
        self._stages: list | None = None   # two pinned blocks big downloads pass through (over shm)
        self._stage_lock = threading.Lock()
        self.devtype = torch._C._get_privateuse1_backend_name()
        C.set_device_count(self.count)
        if hasattr(conn.transport, "find_shared") and hasattr(C, "pinned_region"):
            conn.transport.find_shared = _region_finder(C)   # pinned tensors upload with no copy over shm

    def _index(self, op) -> int:
        idx = self.ops.get(op)
        if idx is None:
            idx = self.ops[op] = len(self.ops) + 1
            name = f"{op._schema.name[6:]}.{op._overloadname}"
            self.conn.post([Msg.DEFINE, idx, name, str(op._schema)])
        return idx

    def post_op(self, op, args, kwargs, outs) -> None:
        with self.lock:
            self.conn.post([Msg.OP, self.C.drain_events(), self._index(op), args, kwargs, outs])

    def call_op(self, op, args, kwargs, first_id: int, count: int):
        with self.lock:
            fut = self.conn.request([Msg.CALL, self.C.drain_events(), self._index(op), args, kwargs, first_id, count])
        reply = fut.result()
        reply.release()
        return reply.meta[0]

    def upload(self, desc, data, non_blocking: bool = False) -> None:
        view = as_bytes_view(data)
        shared = self._shared(data)
        piece = self.piece_bytes(shared)
        if view.nbytes <= piece or not _contiguous(desc[3], desc[4]):
            with self.lock:
                self.conn.post([Msg.UPLOAD, self.C.drain_events(), desc], [view])
        else:
            # in pieces, the lock let go between them: other threads' ops never wait for the whole upload,
            # and the server copies each piece to the device while the next one arrives
            for offset in range(0, view.nbytes, piece):
                with self.lock:
                    self.conn.post([Msg.UPLOAD_PART, self.C.drain_events(), desc, offset], [view[offset:offset + piece]])
        if shared and not non_blocking:
            # sent by naming the pinned memory, not copied: as CUDA's copy from pinned memory, a
            # blocking one returns once the device has the bytes, so the caller may change them then
            self.request([Msg.SYNC])

    def piece_bytes(self, shared: bool = False) -> int:
        """The size of an upload's pieces: named pinned memory, other memory over shm, else."""
        if shared:
            return SHARED_PIECE_BYTES
        return SHM_PIECE_BYTES if self.conn.transport_name == "shm" else UPLOAD_PIECE_BYTES

    def _shared(self, data) -> bool:
        """Whether the transport will name ``data`` (a tensor or bytes-like) rather than copy it: pinned, over shm."""
        finder = getattr(self.conn.transport, "find_shared", None)
        if finder is None or data.nbytes <= max(SHARED_MIN_BYTES, self.conn.settings.post_copy_bytes):
            return False   # (buffers a post copies at once never reach the transport as they are)
        addr = data.data_ptr() if isinstance(data, torch.Tensor) else np.frombuffer(data, np.uint8).ctypes.data
        return finder(addr, data.nbytes) is not None

    def download(self, desc, into: memoryview) -> None:
        if self._shared(into) and _contiguous(desc[3], desc[4]):
            self._fill(desc, 0, into).result().release()   # pinned: the server writes into it in place
            return
        if into.nbytes >= STAGED_DOWNLOAD_BYTES and _contiguous(desc[3], desc[4]) and self._download_stages():
            with self._stage_lock:
                self._download_staged(desc, into)
            return
        with self.lock:
            fut = self.conn.request([Msg.DOWNLOAD, self.C.drain_events(), desc], reply_into=[into])
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
        with self.lock:
            fut = self.conn.request([Msg.DOWNLOAD, self.C.drain_events(), desc, offset], [into])
        return fut

    def _download_stages(self) -> bool:
        """Whether big downloads can go through pinned stages the server fills in place (made on first use)."""
        if self._stages is None:
            self._stages = []
            if getattr(self.conn.transport, "find_shared", None) is not None:
                # .pin_memory(), not empty(pin_memory=True): where CUDA is there too, the latter takes CUDA's allocator
                stages = [torch.empty(SHARED_PIECE_BYTES + STAGED_DOWNLOAD_BYTES, dtype=torch.uint8).pin_memory()
                          for _ in range(2)]
                if all(self._shared(st) for st in stages):   # (memfd blocks: not where pinning is plain memory)
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

    def post(self, meta: list) -> None:
        with self.lock:
            self.conn.post(meta)

    def request(self, meta: list):
        with self.lock:
            fut = self.conn.request(meta)
        reply = fut.result()
        reply.release()
        return reply.meta

    def flush_events(self) -> None:
        with self.lock:
            events = self.C.drain_events()
            if events:
                self.conn.post([Msg.EVENTS, events])

    def close(self) -> None:
        try:
            self.flush_events()
            self.conn.close()
        except Exception:  # the server may already be gone at exit
            pass


def _copy_out(fut, lo: int, hi: int, stage: memoryview, into: memoryview) -> None:
    fut.result().release()
    fastcopy.copy(into[lo:hi], stage[:hi - lo])


def _region_finder(C):
    def find(addr: int, nbytes: int):
        region = C.pinned_region(addr)
        return tuple(region) if region else None
    return find


def _contiguous(sizes, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def current() -> Session | None:
    return _session


def get() -> Session:
    """The session, started (C++ part loaded, server connected) on first use."""
    s = _session
    if s is not None:
        return s
    with _lock:
        if _session is None:
            C = build.load()
            from rgpu.transport.client import connect

            use(connect("ops", options={"torch": torch.__version__, "python": sys.version.split()[0]}), C)
        return _session


def use(conn, C=None) -> Session:
    """Make ``conn`` the session's connection (closing the previous one)."""
    global _session
    from . import registration

    with _lock:
        old, _session = _session, Session(conn, C or build.load())
        fast = fast_path()
        registration.fast_path(_session, fast)
        if old is not None:
            old.close()
            from . import meta

            meta.clear()
        else:
            registration.claim_composites(_session.C, fast)
            atexit.register(lambda: _session is not None and _session.close())
        from . import torch_rgpu

        torch_rgpu.send_pending_seeds(_session)
    return _session


def fast_path() -> bool:
    """Whether ops whose plan is known stream from C++ (``RGPU_FAST_PATH``, read when a session starts)."""
    from rgpu import config

    return config.settings().fast_path


def stats(reset: bool = False) -> dict:
    """transport, messages, round_trips, bytes_out, bytes_in since import (or the last reset)."""
    s = _session
    counts = dict(s.conn.stats) if s is not None else {"messages": 0, "round_trips": 0, "bytes_out": 0, "bytes_in": 0}
    base = _baseline.get(id(s), {})
    out = {"transport": getattr(s.conn, "transport_name", None) if s is not None else None}
    out.update({k: v - base.get(k, 0) for k, v in counts.items()})
    if reset:
        _baseline.clear()
        _baseline[id(s)] = counts
    return out


_baseline: dict = {}
