"""Big frames over tcp on a resumable session (the default): a frame over the replay bound is never copied
for a replay (its copy cost as long as its send: 0.46x a raw socket at 64-256 MiB on the 2-core machine,
0.98x without it), while what is kept still is, byte for byte."""
from __future__ import annotations

import numpy as np

from rgpu.transport.resume import ReplayLog
from rgpu.transport.resume_server import ResumableEnd
from rgpu.transport.wire import MsgKind, encode_prefix

BOUND = 1 << 16


def frame(kind: MsgKind, seq: int, *bufs) -> list:
    return [encode_prefix(kind, seq, 0, b"", [len(memoryview(b)) for b in bufs]), *bufs]


class _NoCopy(bytearray):
    """Caller memory that fails the test if anything copies it (``bytes(x)`` calls its __bytes__; passed as itself, not through a memoryview)."""

    def __bytes__(self):
        raise AssertionError("a frame over the replay bound was copied")


def test_a_frame_over_the_bound_is_not_copied_and_the_frames_after_it_are():
    log = ReplayLog(BOUND, owned=64)
    big, after = _NoCopy(BOUND * 2), bytearray(b"a" * 100)
    parts = [*frame(MsgKind.REQUEST, 1, big), *frame(MsgKind.REQUEST, 2, memoryview(after))]
    log.add(parts)
    after[:] = b"z" * 100            # the caller's memory changes once the send returned
    assert log.gap == 1              # the big one is not kept: a drop before it is applied ends the session
    kept = log.after(0)
    assert bytes(kept[1]) == b"a" * 100   # the frame after it was copied when kept
    assert log.frames[0][0] == 2


def test_a_bye_after_a_frame_over_the_bound_is_still_noticed():
    log = ReplayLog(BOUND, owned=64)
    parts = [*frame(MsgKind.POST, 1, _NoCopy(BOUND * 2)), *frame(MsgKind.BYE, 2)]
    assert log.add(parts) is True


class _Inner:
    def __init__(self):
        self.sent = []

    def send(self, parts):
        self.sent.append(parts)


def test_the_server_keeps_no_copy_of_an_answer_over_the_bound_and_copies_the_others():
    end = ResumableEnd.__new__(ResumableEnd)   # only _keep's state: no sockets
    end.bound, end.kept, end.lost_upto = BOUND, 0, 0
    from collections import deque
    end.answers = deque()
    end._keep(3, frame(MsgKind.REPLY, 3, _NoCopy(BOUND * 2)))
    assert end.lost_upto == 3 and not end.answers
    small = bytearray(b"s" * 10)
    end._keep(4, frame(MsgKind.REPLY, 4, memoryview(small)))
    small[:] = b"x" * 10
    assert end.answers[0][0] == 4 and bytes(end.answers[0][1][1]) == b"s" * 10


def test_uploads_and_downloads_over_and_under_the_bound_arrive_byte_exact(start_server):
    # a resumable session (the default grace) with a small bound, so a few MiB are past it both ways
    server = start_server(env={"RGPU_REPLAY_BYTES": "1M", "RGPU_SESSION_GRACE": "30"})
    conn = server.connect("echo", transport="tcp", replay_bytes=1 << 20)
    assert type(conn.transport).__name__ == "ResumingTransport"
    stride = 4093
    for n in (100_000, 3 << 20, (8 << 20) + 5):
        src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        sums = conn.call({"op": "checksum", "stride": stride}, [src]).meta["sums"]
        assert sums == [int(src[::stride].sum(dtype=np.uint64))]
        back = np.zeros(n, np.uint8)
        conn.call({"op": "fill", "n": n}, reply_into=[back])
        assert np.array_equal(back, (np.arange(n) % 256).astype(np.uint8))
    back = [bytearray(64)]               # and small frames after them, on the same session
    conn.call({"op": "echo"}, [b"q" * 64], reply_into=back)
    assert bytes(back[0]) == b"q" * 64
