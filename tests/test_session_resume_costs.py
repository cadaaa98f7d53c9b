"""What a resumable session's every call pays (transport/resume.py, replay_log.py, resume_server.py): the
fast paths for one frame keep what the general walk keeps, the log has one owner (the writer forgets
what a reader saw acknowledged), and a request is acknowledged by its answer alone."""
from __future__ import annotations

import random

import numpy as np

from rgpu import config
from rgpu.transport.base import Transport
from rgpu.transport.replay_log import ReplayLog
from rgpu.transport.resume import ResumingTransport
from rgpu.transport.resume_server import ACK_EVERY, ResumableEnd
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import Frame, MsgKind, encode_prefix

OWNED = 64


def frame(kind: MsgKind, seq: int, *bufs) -> list:
    return [encode_prefix(kind, seq, 0, b"", [memoryview(b).nbytes for b in bufs]), *bufs]


class Wire(Transport):
    """A transport that records what was sent and hands out the frames it is given."""
    name = "tcp"
    capabilities = TcpTransport.capabilities
    spin_s = 0.0

    def __init__(self):
        self.sent, self.frames, self.sock = [], [], None

    def send(self, parts):
        self.sent.append([bytes(p) for p in parts])

    def recv_frame(self, limits, pool, into=None):
        return self.frames.pop(0)

    def close(self):
        pass

    def abort(self):
        pass


def _client() -> tuple[ResumingTransport, Wire]:
    wire = Wire()
    t = ResumingTransport(wire, {"id": "x", "grace_s": 1}, None, config.settings(environ={}), "nowhere")
    t._said_bye = True                 # (no goodbye at the test's exit: there is no server)
    return t, wire


def _buffer(rng: random.Random, kind: MsgKind, callers: list):
    """A buffer as a connection sends it: immutable bytes, or a view of memory that is the caller's (a
    request's, a post's over ``OWNED``: it may change once the send returns) or the connection's own."""
    data = bytearray(rng.randbytes(rng.choice([1, 8, OWNED, OWNED + 1, 300])))
    if rng.random() < 0.3:
        return bytes(data)
    if kind != MsgKind.POST or len(data) > OWNED:
        callers.append(data)
    return memoryview(data) if rng.random() < 0.5 else np.frombuffer(data, np.uint8)


def test_one_frame_or_several_a_replay_writes_the_bytes_sent_whatever_the_caller_changed_after():
    rng = random.Random(7)
    for _ in range(300):
        fast, walked, seq, sent, callers = ReplayLog(1 << 20, OWNED), ReplayLog(1 << 20, OWNED), 0, [], []
        for _ in range(rng.randint(1, 4)):
            parts = []
            for _ in range(rng.randint(1, 3)):
                seq += 1
                kind = rng.choice([MsgKind.POST, MsgKind.REQUEST])
                parts += frame(kind, seq, *[_buffer(rng, kind, callers) for _ in range(rng.randint(0, 2))])
            sent.append(b"".join(bytes(memoryview(p)) for p in parts))
            fast.add(parts)             # one frame: its own path; several: the walk
            walked._add_frames(parts)   # always the walk
        for data in callers:            # the caller's memory changes once each send returned
            data[:] = b"\xee" * len(data)
        for log in (fast, walked):
            assert b"".join(bytes(memoryview(p)) for p in log.after(0)) == b"".join(sent)
            assert log.nbytes == len(b"".join(sent)) and [s for s, _, _ in log.frames] == \
                [s for s, _, _ in walked.frames]


def test_a_requests_buffer_is_copied_and_a_small_posts_is_kept_by_reference_when_alone_in_its_send():
    log = ReplayLog(1 << 20, OWNED)
    asked, posted = bytearray(b"r" * 8), bytearray(b"p" * 8)
    request = frame(MsgKind.REQUEST, 1, memoryview(asked))
    log.add(request)
    post = frame(MsgKind.POST, 2, memoryview(posted))
    log.add(post)
    asked[:] = b"x" * 8
    assert bytes(log.frames[0][1][1]) == b"r" * 8 and log.frames[1][1] is post
    assert log.nbytes == sum(len(memoryview(p)) for p in request + post)


def test_a_frame_over_the_bound_alone_in_its_send_is_never_kept():
    log = ReplayLog(64, OWNED)
    assert log.add(frame(MsgKind.REQUEST, 1, memoryview(bytearray(100)))) is False
    assert log.gap == 1 and not log.frames and log.nbytes == 0


def test_the_reply_a_reader_saw_is_forgotten_by_the_next_send_and_never_replayed():
    t, wire = _client()
    t.send(frame(MsgKind.REQUEST, 1, memoryview(bytearray(b"a" * 8))))
    wire.frames.append(Frame(MsgKind.REPLY, 1, 1, None, []))
    t.recv_frame(None, None)
    assert t.acked == 1 and t.received == 1   # noted by the reader; the log is the writer's
    t.send(frame(MsgKind.REQUEST, 2))
    assert [s for s, _, _ in t.log.frames] == [2]
    assert t.log.nbytes == len(wire.sent[-1][0])


def test_an_ack_read_while_the_log_fills_makes_room_at_once():
    t, wire = _client()
    t.log.bound, t._half = 4096, 2048

    def read_acks():                    # the connection's on_acks: it reads the server's seq-0 reply
        wire.frames.append(Frame(MsgKind.REPLY, 0, 9, None, []))
        t.recv_frame(None, None)
    t.on_acks = read_acks
    for seq in range(1, 11):
        t.send(frame(MsgKind.POST, seq, bytes(400)))
    assert t.log.nbytes <= t._half and t.log.gap == 0 and [s for s, _, _ in t.log.frames] == [10]


def test_the_connections_on_block_hook_reaches_each_connection_it_writes_on():
    t, wire = _client()
    hook = lambda: None                 # noqa: E731
    t.on_block = hook
    assert t.on_block is hook and wire.on_block is hook


def _server() -> tuple[ResumableEnd, Wire]:
    wire = Wire()
    return ResumableEnd(wire, "s", "x", 1.0, 1 << 20, config.settings(environ={}), client_bound=1 << 30), wire


def test_requests_are_acknowledged_by_their_answers_and_posts_every_so_many_seqs():
    end, wire = _server()
    for seq in range(1, 2 * ACK_EVERY + 1):
        wire.frames.append(Frame(MsgKind.REQUEST, seq, 0, None, [memoryview(bytearray(8))]))
        end.recv_frame(None, None)
        end.send(end.frame_parts(MsgKind.REPLY, seq, seq, None, [memoryview(bytearray(8))]))
    assert all(int.from_bytes(p[0][12:20], "little") for p in wire.sent)   # no seq-0 acknowledgement
    first = 2 * ACK_EVERY
    for seq in range(first + 1, first + ACK_EVERY + 1):
        wire.frames.append(Frame(MsgKind.POST, seq, 0, None, []))
        end.recv_frame(None, None)
    acks = [p for p in wire.sent if not int.from_bytes(p[0][12:20], "little")]
    assert len(acks) == 1 and int.from_bytes(acks[0][0][20:28], "little") == first + ACK_EVERY


def test_a_replayed_frame_is_skipped_and_an_answer_is_kept_as_sent():
    end, wire = _server()
    wire.frames += [Frame(MsgKind.POST, 1, 0, None, []), Frame(MsgKind.POST, 1, 0, None, []),
                    Frame(MsgKind.REQUEST, 2, 0, None, [])]
    assert end.recv_frame(None, None).seq == 1 and end.recv_frame(None, None).seq == 2 and end.done == 2
    out = bytearray(b"o" * 8)
    end.send(end.frame_parts(MsgKind.REPLY, 2, 2, None, [memoryview(out)]))
    out[:] = b"x" * 8
    assert end.answers[-1][0] == 2 and bytes(end.answers[-1][1][1]) == b"o" * 8


def test_an_answer_over_the_bound_sent_is_never_kept_and_the_older_ones_stay():
    end, wire = _server()
    end.bound = 1000
    end.send(end.frame_parts(MsgKind.REPLY, 1, 1, None, [memoryview(bytearray(10))]))
    end.send(end.frame_parts(MsgKind.REPLY, 2, 2, None, [memoryview(bytearray(5000))]))
    assert [s for s, _, _ in end.answers] == [1] and end.lost_upto == 2 and len(wire.sent) == 2
    for seq in range(3, 3 + 200):       # past the bound in all: the oldest go first
        end.send(end.frame_parts(MsgKind.REPLY, seq, seq, None, [memoryview(bytearray(10))]))
    assert end.kept <= end.bound and end.kept == sum(n for _, _, n in end.answers)
    assert end.lost_upto == end.answers[0][0] - 1 and end.answers[-1][0] == 202
