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
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgpack

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
    from .buffers import as_bytes_view
    views = [as_bytes_view(b) for b in buffers]
    prefix = encode_prefix(kind, seq, ack, pack_meta(meta), [v.nbytes for v in views])
    return b"".join([prefix, *[bytes(v) for v in views]])
