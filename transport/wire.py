"""The rgpu frame: a fixed binary header, msgpack metadata, then raw buffers.

    offset size  field
    0      4     magic        b"RGPU"
    4      2     version      PROTOCOL_VERSION; a mismatch is VersionMismatch, not ProtocolError
    6      2     kind         MsgKind
    8      4     flags        reserved bits, must be 0 except those in Flags
    12     8     seq          sender's sequence number (posts too)
    20     8     ack          replies: highest sequence number applied by the sender; a client's
                                request: the seq of the last answer it read (0: not said)
    28     4     meta_len     bytes of msgpack metadata
    32     4     nbufs        raw buffers that follow
    36     8*n   buffer lengths (u64 each)
    ...          metadata, then each buffer, back to back

Metadata decodes to a closed set of types (None, bool, int, float, str, bytes,
list, dict); extension types are refused. Nothing is ever unpickled or evaluated.

A frame's buffers, below the codec: ``as_bytes_view`` turns bytes, memoryviews, numpy
arrays and CPU torch tensors (every dtype, bfloat16 and bool included) into a flat byte
memoryview that shares their memory (only a non-contiguous source costs one copy);
``writable_view`` is memory a reply may land in; ``BufferPool`` is where received
buffers come from when the caller names none.
"""
from __future__ import annotations

import struct
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from rgpu.errors import ProtocolError, VersionMismatch
# the constants are rgpu.protocol's (C reads them from rgpu_protocol.h); the codec below uses them
from rgpu.protocol.wire import HEADER, KNOWN_FLAGS, LENGTH, MAGIC, PROTOCOL_VERSION, Flags, MsgKind  # noqa: F401

_KINDS = {int(k): k for k in MsgKind}   # a dict lookup: MsgKind(n) costs 10x more on every frame
_LENGTH_STRUCTS = {n: struct.Struct(f"<{n}Q") for n in range(1, 65)}


_PREFIX_STRUCTS = {n: struct.Struct(HEADER.format + f"{n}Q") for n in range(17)}


def _lengths_struct(n: int) -> struct.Struct:
    return _LENGTH_STRUCTS.get(n) or struct.Struct(f"<{n}Q")


@dataclass(frozen=True)
class Limits:
    """Bounds on what a decoder accepts; every length from the wire is checked."""
    max_frame_bytes: int = 2 << 30
    max_meta_bytes: int = 64 << 20
    max_buffers: int = 65536

    @classmethod
    def from_settings(cls, s) -> "Limits":
        return cls(s.max_frame_bytes, s.max_meta_bytes, s.max_buffers)


@dataclass
class Header:
    kind: MsgKind
    seq: int
    ack: int
    flags: int
    meta_len: int
    nbufs: int


@dataclass(slots=True)
class Frame:
    """A received frame. ``buffers`` may belong to a pool: call ``release()`` when done."""
    kind: MsgKind
    seq: int
    ack: int
    meta: Any
    buffers: list[memoryview] = field(default_factory=list)
    releaser: Callable[[], None] | None = None

    def release(self) -> None:
        if self.releaser is not None:
            self.releaser()
            self.releaser = None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"metadata: extension type {code} is not allowed")


_packers = threading.local()  # Why: msgpack.packb builds a Packer per call (half the cost of a small op's meta)


def meta_packer() -> msgpack.Packer:
    """msgpack's Packer as ``pack_meta`` encodes: one per user (a Packer's buffer is not shareable)."""
    return msgpack.Packer(use_bin_type=True)


def pack_meta(meta: Any) -> bytes:
    if meta is None:
        return b""  # no metadata block at all: decodes back to None
    packer = getattr(_packers, "p", None)
    if packer is None:
        packer = _packers.p = meta_packer()
    try:
        return packer.pack(meta)  # resets its buffer on failure too
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"metadata: cannot encode {type(meta).__name__}: {exc}") from None


# msgpack decodes extension type -1 (timestamp) itself, without calling ext_hook; these are
# its three encodings. Seeing one of these byte pairs (maybe inside a string) costs one walk.
_TIMESTAMP_MARKS = (b"\xd6\xff", b"\xd7\xff", b"\xc7\x0c\xff")


def _has_foreign(value) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, msgpack.Timestamp):
            return True
    return False


_UNPACK_OPTIONS = {"raw": False, "use_list": True, "strict_map_key": False, "ext_hook": _refuse_ext}   # unpack_meta's


def unpack_spec() -> tuple:
    """msgpack's decode as ``unpack_meta`` calls it, for C code that checks the timestamp marks itself:
    (function, option names, option values), called by vectorcall (a partial's merge of them cost as much
    again as the decode of a small meta)."""
    return msgpack.unpackb, tuple(_UNPACK_OPTIONS), tuple(_UNPACK_OPTIONS.values())


_unpackb = msgpack.unpackb


def unpack_meta(data, limits: Limits) -> Any:
    if not len(data):
        return None
    try:   # (the options spelled out, not ``**_UNPACK_OPTIONS``: every frame's meta passes here, and a dict
        # unpacked per call cost twice the decode of a small meta)
        meta = _unpackb(data, raw=False, use_list=True, strict_map_key=False, ext_hook=_refuse_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"metadata: undecodable msgpack ({type(exc).__name__}: {exc})") from None
    raw = data.tobytes() if type(data) is memoryview else data   # (a view's tobytes(): a quarter of bytes(view))
    if 255 in raw and any(mark in raw for mark in _TIMESTAMP_MARKS) and _has_foreign(meta):
        raise ProtocolError("metadata: extension type -1 (timestamp) is not allowed")
    return meta


def encode_prefix(kind: int, seq: int, ack: int, meta: bytes, lengths: Sequence[int], flags: int = 0) -> bytes:
    """Header + buffer lengths + metadata: everything before the raw buffers."""
    n = len(lengths)
    prefix = _PREFIX_STRUCTS.get(n)
    if prefix is not None:  # one pack for the header and the lengths: the common case of a few buffers
        return prefix.pack(MAGIC, PROTOCOL_VERSION, kind, flags, seq, ack, len(meta), n, *lengths) + meta
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, flags, seq, ack, len(meta), n)
    return b"".join((head, _lengths_struct(n).pack(*lengths), meta))


def decode_header(raw, limits: Limits) -> Header:
    """Check the fixed header; raises ProtocolError naming the field at fault."""
    if len(raw) < HEADER.size:
        raise ProtocolError(f"header: truncated ({len(raw)} of {HEADER.size} bytes)")
    magic, version, kind, flags, seq, ack, meta_len, nbufs = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ProtocolError(f"magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"peer speaks rgpu protocol {version}, this side speaks {PROTOCOL_VERSION}")
    known = _KINDS.get(kind)
    if known is None:
        raise ProtocolError(f"kind: unknown message kind {kind}")
    kind = known
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"flags: unknown bits {flags & ~KNOWN_FLAGS:#x}")
    if meta_len > limits.max_meta_bytes:
        raise ProtocolError(f"meta_len: {meta_len} bytes exceeds the limit of {limits.max_meta_bytes}")
    if nbufs > limits.max_buffers:
        raise ProtocolError(f"nbufs: {nbufs} buffers exceeds the limit of {limits.max_buffers}")
    return Header(kind, seq, ack, flags, meta_len, nbufs)


def decode_lengths(raw, nbufs: int, meta_len: int, limits: Limits) -> list[int]:
    lengths = list(_lengths_struct(nbufs).unpack_from(raw)) if nbufs else []
    total = meta_len + sum(lengths)
    if total > limits.max_frame_bytes:
        raise ProtocolError(f"buffer lengths: frame of {total} bytes exceeds the limit of {limits.max_frame_bytes}")
    return lengths


def decode_frame(data: bytes, limits: Limits = Limits()) -> Frame:
    """Decode one whole frame held in memory (tests, fuzzing); stream transports read piecewise."""
    mv = memoryview(data)
    h = decode_header(mv, limits)
    pos = HEADER.size
    if len(mv) < pos + 8 * h.nbufs:
        raise ProtocolError("buffer lengths: truncated")
    lengths = decode_lengths(mv[pos:], h.nbufs, h.meta_len, limits)
    pos += 8 * h.nbufs
    end = pos + h.meta_len + sum(lengths)
    if len(mv) < end:
        raise ProtocolError(f"body: truncated ({len(mv) - pos} of {end - pos} bytes)")
    if len(mv) > end:
        raise ProtocolError(f"body: {len(mv) - end} trailing bytes")
    meta = unpack_meta(mv[pos:pos + h.meta_len], limits)
    pos += h.meta_len
    bufs = []
    for n in lengths:
        bufs.append(mv[pos:pos + n])
        pos += n
    return Frame(h.kind, h.seq, h.ack, meta, bufs)


def encode_frame(kind: int, seq: int, meta: Any = None, buffers: Sequence = (), ack: int = 0) -> bytes:
    """Encode one whole frame into bytes (tests, fuzzing); transports send the parts without joining."""
    views = [as_bytes_view(b) for b in buffers]
    prefix = encode_prefix(kind, seq, ack, pack_meta(meta), [v.nbytes for v in views])
    return b"".join([prefix, *[bytes(v) for v in views]])


def frame_parts(kind: int, seq: int, ack: int, meta, views: Sequence[memoryview], flags: int = 0) -> list:
    """The parts of one frame, ready for ``send`` (several frames' parts may be joined): ``kind``, ``seq``,
    ``ack`` (the last seq received, for a resuming peer), ``meta`` (any msgpack value), ``views`` (the
    buffers, sent as they are when ``send`` runs), ``flags`` (``wire``'s frame flags). Returns a list;
    ``ProtocolError`` when ``meta`` holds a type the wire does not carry."""
    prefix = encode_prefix(kind, seq, ack, pack_meta(meta), [v.nbytes for v in views], flags)
    return [prefix, *views] if views else [prefix]


# The memory of a frame's buffers: what may be sent without a copy, and the pool received buffers come from

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
