"""The frame format: round trips, every malformed case named by its field, and a fuzzed decoder."""
from __future__ import annotations

import io
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rgpu.errors import ProtocolError, VersionMismatch
from rgpu.transport.tcp import StreamReader
from rgpu.transport.wire import BufferPool
from rgpu.transport.wire import (
    HEADER, MAGIC, PROTOCOL_VERSION, Flags, Limits, MsgKind, decode_frame, encode_frame, encode_prefix, pack_meta,
)

LIMITS = Limits(max_frame_bytes=1 << 20, max_meta_bytes=64 << 10, max_buffers=64)


def header(kind=MsgKind.POST, seq=1, ack=0, meta_len=0, nbufs=0, flags=0, magic=MAGIC, version=PROTOCOL_VERSION):
    return HEADER.pack(magic, version, int(kind), flags, seq, ack, meta_len, nbufs)


def stream_decode(data: bytes, limits=Limits(), chunk: int | None = None):
    """Decode ``data`` the way a transport does, handing out at most ``chunk`` bytes per receive."""
    src = io.BytesIO(data)

    def recv_into(view):
        n = len(view) if chunk is None else min(len(view), chunk)
        return src.readinto(view[:n])

    return StreamReader(recv_into).read_frame(limits, BufferPool())


CLOSED_TYPES = (type(None), bool, int, float, str, bytes, list, dict)


def only_closed_types(value) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if not isinstance(v, CLOSED_TYPES):
            return False
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return True


# ---- round trips --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(MsgKind))
def test_every_message_kind_round_trips_with_its_seq_ack_meta_and_buffers(kind):
    meta = {"op": "x", "n": [1, 2.5, None, True], "raw": b"\x00\xff"}
    data = encode_frame(kind, 2**64 - 1, meta, [b"abc", b"", bytes(range(256))], ack=7)
    frame = decode_frame(data)
    assert (frame.kind, frame.seq, frame.ack, frame.meta) == (kind, 2**64 - 1, 7, meta)
    assert [bytes(b) for b in frame.buffers] == [b"abc", b"", bytes(range(256))]


@pytest.mark.parametrize("meta", [None, True, False, 0, -1, 2**63, -(2**63), 1.5, float("inf"), "", "é✓",
                                  b"", b"\x00" * 100, [], {}, {"nested": {"deep": [[[1]]]}}, {1: "int keys"}])
def test_metadata_of_every_closed_type_round_trips(meta):
    assert decode_frame(encode_frame(MsgKind.REQUEST, 3, meta)).meta == meta


def test_an_empty_frame_has_a_header_and_nothing_else():
    data = encode_frame(MsgKind.BYE, 0)
    assert len(data) == HEADER.size
    frame = decode_frame(data)
    assert (frame.kind, frame.meta, frame.buffers) == (MsgKind.BYE, None, [])


@pytest.mark.parametrize("meta", [{1, 2}, object(), 2**64, {"f": lambda: 0}])
def test_metadata_outside_the_closed_types_cannot_be_encoded(meta):
    with pytest.raises(ProtocolError, match="metadata"):
        pack_meta(meta)


def test_a_frame_of_more_buffers_than_the_staging_area_holds_streams_whole():
    n = 40000  # 8 bytes of length each: more than the reader's staging buffer
    data = encode_frame(MsgKind.POST, 1, {"a": 1}, [b"x"] * n)
    frame = stream_decode(data)
    assert len(frame.buffers) == n and all(bytes(b) == b"x" for b in frame.buffers)


def test_metadata_larger_than_the_staging_area_streams_whole():
    meta = {"blob": b"m" * (3 * StreamReader.STAGE)}
    assert stream_decode(encode_frame(MsgKind.POST, 1, meta, [b"tail"])).meta == meta


def test_a_stream_delivered_one_byte_at_a_time_decodes_the_same():
    data = encode_frame(MsgKind.REPLY, 9, {"k": [1, 2]}, [b"abc", b"defg"], ack=4)
    frame = stream_decode(data, chunk=1)
    assert (frame.kind, frame.seq, frame.ack, frame.meta) == (MsgKind.REPLY, 9, 4, {"k": [1, 2]})
    assert [bytes(b) for b in frame.buffers] == [b"abc", b"defg"]


def test_the_known_flag_is_accepted():
    prefix = encode_prefix(MsgKind.POST, 1, 0, pack_meta(None), [], flags=int(Flags.LAST_IN_BATCH))
    assert decode_frame(prefix).kind == MsgKind.POST


# ---- malformed frames: each names its field --------------------------------------------------

def _with_lengths(lengths, meta=b"", **kw):
    return header(meta_len=len(meta), nbufs=len(lengths), **kw) + struct.pack(f"<{len(lengths)}Q", *lengths) + meta


def _ext(code: int) -> bytes:
    return b"\xd6" + struct.pack("b", code) + b"abcd"  # fixext 4


MALFORMED = {
    "truncated header": (header()[:20], "header"),
    "truncated buffer lengths": (header(nbufs=2) + b"\x00" * 8, "buffer lengths"),
    "truncated body": (_with_lengths([10]) + b"short", "body"),
    "trailing bytes": (header() + b"junk", "body"),
    "wrong magic": (header(magic=b"HTTP"), "magic"),
    "unknown kind": (header(kind=99), "kind"),
    "kind zero": (header(kind=0), "kind"),
    "unknown flags": (header(flags=0x80), "flags"),
    "absurd metadata length": (header(meta_len=2**32 - 1), "meta_len"),
    "absurd buffer count": (header(nbufs=2**32 - 1), "nbufs"),
    "absurd buffer length": (_with_lengths([2**64 - 1]), "buffer lengths"),
    "buffers that add up past the frame limit": (_with_lengths([600 << 10, 600 << 10]), "buffer lengths"),
    "undecodable metadata": (_with_lengths([], b"\xc1"), "metadata"),
    "metadata with trailing bytes": (_with_lengths([], b"\x01\x02"), "metadata"),
    "truncated metadata": (_with_lengths([], b"\x92\x01"), "metadata"),
    "invalid utf-8 in a string": (_with_lengths([], b"\xa2\xff\xfe"), "metadata"),
    "an extension type": (_with_lengths([], _ext(5)), "metadata"),
    "a negative extension type": (_with_lengths([], _ext(-5)), "metadata"),
    "a msgpack timestamp": (_with_lengths([], msgpack.packb(msgpack.Timestamp(1, 0))), "metadata"),
    "a timestamp inside a list": (_with_lengths([], msgpack.packb([1, {"t": msgpack.Timestamp(2, 5)}])), "metadata"),
    "a list as a map key": (_with_lengths([], b"\x81\x91\x01\x02"), "metadata"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_frame_is_a_protocol_error_naming_its_field(case):
    data, field = MALFORMED[case]
    with pytest.raises(ProtocolError, match=f"^{field}"):
        decode_frame(data, LIMITS)


@pytest.mark.parametrize("case", [c for c in MALFORMED if c not in ("truncated header", "truncated buffer lengths",
                                                                 "truncated body", "trailing bytes")])
def test_a_stream_reader_refuses_the_same_frames_for_the_same_field(case):
    data, field = MALFORMED[case]
    with pytest.raises(ProtocolError, match=f"^{field}"):
        stream_decode(data + b"\x00" * 64, LIMITS)


def test_a_stream_that_ends_inside_a_frame_is_an_end_of_file_not_a_frame():
    data = encode_frame(MsgKind.POST, 1, {"a": 1}, [b"x" * 1000])
    for cut in (0, 10, HEADER.size, HEADER.size + 8, len(data) - 1):
        with pytest.raises(EOFError):
            stream_decode(data[:cut])


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 0xFFFF])
def test_another_protocol_version_is_a_version_mismatch_not_a_protocol_error(version):
    with pytest.raises(VersionMismatch, match=f"protocol {version}"):
        decode_frame(header(version=version))


# ---- fuzzing --------------------------------------------------------------------------------

meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
frames = st.builds(
    lambda kind, seq, ack, meta, bufs: encode_frame(kind, seq, meta, bufs, ack=ack),
    st.sampled_from(list(MsgKind)), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), meta_values,
    st.lists(st.binary(max_size=64), max_size=4))


# valid frames to damage: every kind, metadata of every closed type, 0-3 buffers (built once: drawing
# recursive metadata per example would cost most of the fuzzing time)
FRAME_POOL = [encode_frame(kind, seq, meta, bufs, ack=seq // 2)
              for kind, seq in zip(MsgKind, range(1, 100, 7))
              for meta, bufs in [(None, []), ({"op": "x", "n": [1, -1, 2.5, None, True]}, [b"abc"]),
                                 ([b"\x00\xff", "é", {"k": {}}], [b"", b"x" * 40]), (2**63, [b"y" * 3] * 3)]]


@st.composite
def damaged_frames(draw):
    data = bytearray(draw(st.sampled_from(FRAME_POOL)))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert", "header"]))
        if how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        elif how == "cut":
            del data[draw(st.integers(0, len(data))):]
        elif how == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif how == "header":  # scribble over a header field with an extreme value
            off, size = draw(st.sampled_from([(6, 2), (8, 4), (28, 4), (32, 4)]))
            if len(data) >= off + size:
                data[off:off + size] = draw(st.sampled_from([b"\x00", b"\xff", b"\x7f"])) * size
    return bytes(data)


def _decode_or_refuse(data: bytes):
    """Decoding either returns a frame of closed types or raises one of the two wire errors."""
    try:
        frame = decode_frame(data, LIMITS)
    except (ProtocolError, VersionMismatch):
        return None
    assert isinstance(frame.kind, MsgKind)
    assert only_closed_types(frame.meta)
    return frame


@settings(settings.get_profile("rgpu-fuzz"))
@given(st.binary(max_size=256) | st.builds(lambda tail: header() + tail, st.binary(max_size=128)) | damaged_frames())
def test_fuzzed_bytes_decode_to_closed_types_or_raise_only_wire_errors(data):
    frame = _decode_or_refuse(data)
    if frame is not None:  # the stream reader agrees with the in-memory decoder
        again = stream_decode(data, LIMITS, chunk=7)
        assert (again.kind, again.seq, again.ack) == (frame.kind, frame.seq, frame.ack)
        assert pack_meta(again.meta) == pack_meta(frame.meta)  # compares NaN too
        assert [bytes(b) for b in again.buffers] == [bytes(b) for b in frame.buffers]


@settings(settings.get_profile("rgpu-fuzz"), max_examples=max(1, settings.get_profile("rgpu-fuzz").max_examples // 10))
@given(frames)
def test_fuzzed_frames_round_trip_exactly(data):
    frame = decode_frame(data)
    assert encode_frame(frame.kind, frame.seq, frame.meta, frame.buffers, ack=frame.ack) == data
