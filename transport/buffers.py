"""What may be sent without a copy, and the pool that received buffers come from.

``as_bytes_view`` turns bytes, memoryviews, numpy arrays and CPU torch tensors
(every dtype, bfloat16 and bool included) into a flat byte memoryview that
shares their memory; only a non-contiguous source costs one copy.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np


def as_bytes_view(obj) -> memoryview:
    """A 1-D unsigned-byte view of ``obj``'s memory (a copy only if it is not contiguous)."""
    if isinstance(obj, memoryview):
        if obj.c_contiguous:
            return obj.cast("B") if (obj.format != "B" or obj.ndim != 1) else obj
        return memoryview(obj.tobytes())
    if isinstance(obj, (bytes, bytearray)):
        return memoryview(obj)
    if isinstance(obj, np.ndarray):
        if obj.flags.c_contiguous and not obj.dtype.hasobject:
            try:
                return memoryview(obj).cast("B")  # cheaper than reshape + view on every send
            except (TypeError, ValueError):
                pass  # formats a memoryview cannot cast: complex, structured, big-endian, 0-d
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
        return memoryview(arr.reshape(-1).view(np.uint8))
    if type(obj).__module__.startswith("torch"):
        return _tensor_view(obj)
    try:
        return as_bytes_view(memoryview(obj))
    except TypeError:
        raise TypeError(f"cannot send a {type(obj).__name__}: expected bytes, memoryview, numpy array or CPU tensor") from None


class Held(np.ndarray):
    """Bytes their owner leaves unchanged until the peer has acknowledged the frames that carry them: a
    resumable connection's replay log keeps them by reference, where it copies other posted memory (it may
    change once ``post()`` returns). Made by ``held``; slices of its views are held too."""


def held(view: memoryview) -> memoryview:
    """``view``'s bytes, marked ``Held`` (no copy): the sender waits for the acknowledgement itself."""
    return memoryview(np.frombuffer(view, dtype=np.uint8).view(Held))


def copied(buffers) -> list[memoryview]:
    """Each buffer's bytes, copied: what a sender keeps when its caller may change the buffers at once."""
    return [memoryview(bytearray(as_bytes_view(b))) for b in buffers]


_NUMPY_DTYPES = None  # torch dtypes numpy holds and a memoryview casts to bytes (filled on first use)


def _tensor_view(t) -> memoryview:
    import torch  # only reached when a tensor is passed, so torch is already loaded

    if t.device.type != "cpu":
        raise TypeError(f"only CPU tensors can be sent as buffers, got one on {t.device}")
    if t.requires_grad:
        t = t.detach()
    global _NUMPY_DTYPES
    if _NUMPY_DTYPES is None:
        _NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                         torch.int8, torch.uint8, torch.bool}
    if t.dtype in _NUMPY_DTYPES and t.dim() and t.numel() and t.is_contiguous() and not t.is_neg():
        return memoryview(t.numpy()).cast("B")  # the common dtypes, without a reshape or a uint8 view
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def writable_view(obj) -> memoryview:
    """A 1-D byte view of caller memory to receive into; refuses what would only fill a copy."""
    if isinstance(obj, np.ndarray) and not obj.flags.c_contiguous:
        raise TypeError("a receive target must be contiguous (this numpy array is not)")
    if type(obj).__module__.startswith("torch") and hasattr(obj, "is_contiguous"):
        if not obj.is_contiguous() or obj.is_conj() or obj.is_neg():
            raise TypeError("a receive target must be a contiguous tensor without a conjugate or negative bit")
    if isinstance(obj, memoryview) and not obj.c_contiguous:
        raise TypeError("a receive target must be contiguous (this memoryview is not)")
    view = as_bytes_view(obj)
    if view.readonly:
        raise TypeError(f"a receive target must be writable, not a read-only {type(obj).__name__}")
    return view


def nbytes(obj) -> int:
    return as_bytes_view(obj).nbytes


class BufferPool:
    """Reusable receive buffers by power-of-two size class.

    A buffer leased to a consumer is not handed out again until it is released;
    at most ``keep_bytes`` of free buffers are kept (fresh pages cost a fault each,
    so reuse matters for big transfers).
    """

    def __init__(self, keep_bytes: int = 512 << 20):
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._kept = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(n: int) -> int:
        return max(4096, 1 << (max(n, 1) - 1).bit_length())

    def lease(self, n: int) -> tuple[memoryview, np.ndarray]:
        """A writable view of ``n`` bytes and the token to release it with."""
        cls = self._size_class(n)
        with self._lock:
            free = self._free.get(cls)
            block = free.pop() if free else None
            if block is not None:
                self._kept -= cls
        if block is None:
            block = np.empty(cls, dtype=np.uint8)
        return memoryview(block)[:n], block

    def release(self, block: np.ndarray) -> None:
        cls = block.nbytes
        with self._lock:
            if self._kept + cls <= self.keep_bytes:
                self._free[cls].append(block)
                self._kept += cls
