"""The client's replay log (transport/resume.py): what it keeps, by reference or copied, and what a replay writes."""
from __future__ import annotations

from rgpu.transport.resume import ReplayLog
from rgpu.transport.wire import MsgKind, encode_prefix

OWNED = 64


def frame(kind: MsgKind, seq: int, *bufs) -> list:
    return [encode_prefix(kind, seq, 0, b"", [len(memoryview(b)) for b in bufs]), *bufs]


def send(log: ReplayLog, *frames) -> list:
    parts = [p for f in frames for p in f]
    log.add(parts)
    return parts


def test_a_send_is_kept_by_reference_and_goes_once_its_last_frame_is_acknowledged():
    log = ReplayLog(1 << 20, OWNED)
    parts = send(log, frame(MsgKind.POST, 1, memoryview(bytearray(8))), frame(MsgKind.POST, 2))
    assert log.frames[0][1] is parts and log.frames[0][0] == 2
    log.trim(1)                      # acknowledgements are cumulative: the send stays until seq 2 is applied
    assert len(log.frames) == 1
    log.trim(2)
    assert not log.frames and log.nbytes == 0


def test_the_callers_memory_is_copied_and_the_connections_own_is_not():
    log = ReplayLog(1 << 20, OWNED)
    mine, big, asked = bytearray(b"a" * 8), bytearray(b"b" * 100), bytearray(b"c" * 8)
    send(log, frame(MsgKind.POST, 1, memoryview(mine)), frame(MsgKind.POST, 2, memoryview(big)),
         frame(MsgKind.REQUEST, 3, memoryview(asked)))
    big[:] = b"x" * 100              # the caller changes its memory once the send returned
    asked[:] = b"y" * 8
    kept = log.after(0)
    assert kept[1].obj is mine       # a small post's buffer: the connection's copy, named
    assert bytes(kept[3]) == b"b" * 100 and bytes(kept[5]) == b"c" * 8


def test_a_replay_starts_inside_a_send_the_server_applied_in_part():
    log = ReplayLog(1 << 20, OWNED)
    send(log, *[frame(MsgKind.POST, s, memoryview(bytearray([s]))) for s in (1, 2, 3)])
    send(log, frame(MsgKind.REQUEST, 4))
    again = log.after(2)
    seqs = [int.from_bytes(p[12:20], "little") for p in again if len(p) >= 36]
    assert seqs == [3, 4] and bytes(again[1]) == b"\x03"


def test_a_frame_over_the_bound_is_never_kept_and_marks_the_gap():
    log = ReplayLog(64, OWNED)
    send(log, frame(MsgKind.POST, 1), frame(MsgKind.POST, 2, bytes(200)), frame(MsgKind.POST, 3))
    assert log.gap == 2 and [s for s, _, _ in log.frames] == [1, 3]


def test_a_bye_is_noticed():
    log = ReplayLog(1 << 20, OWNED)
    assert log.add(frame(MsgKind.BYE, 5)) and not log.add(frame(MsgKind.POST, 6))
