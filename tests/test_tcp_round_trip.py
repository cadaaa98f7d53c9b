"""A tcp round trip's own path: a lone call says the last answer it read (so a resumable session's server keeps
no answer the client has), and a send written in one call or cut short by a full socket moves every byte."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from rgpu import config
from rgpu.transport.connection import Connection
from rgpu.transport.resume import ResumingTransport
from rgpu.transport.resume_server import ResumableEnd
from rgpu.transport.tcp import TcpTransport, tune
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view

LIMITS = Limits()


def _tcp_pair() -> tuple[TcpTransport, TcpTransport]:
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    for s in (a, b):
        tune(s)
    return TcpTransport(a), TcpTransport(b)


@pytest.fixture
def session():
    """A resumable session's two ends in one process: the client's connection, the server's end."""
    settings = config.settings(environ={})
    c, s = _tcp_pair()
    client = ResumingTransport(c, {"id": "x", "grace_s": 1}, None, settings, "nowhere")
    client._said_bye = True              # (no goodbye at the test's exit: the server end is ours)
    end = ResumableEnd(s, "sid", "x", 1.0, settings.replay_bytes, settings)
    conn = Connection(client, settings)
    yield conn, end
    conn.close(0.1)
    end.close()


def test_a_lone_call_says_the_last_answer_it_read_and_the_server_keeps_only_the_answers_after_it(session):
    conn, end = session
    rng = np.random.default_rng(3)
    pool, back = BufferPool(), memoryview(bytearray(64))
    for seq in range(1, 41):
        data = rng.integers(0, 256, 64, dtype=np.uint8)
        end.send(end.frame_parts(MsgKind.REPLY, seq, seq, {"n": seq}, [as_bytes_view(data)]))   # answered ahead
        reply = conn.call({"op": "echo"}, [data], reply_into=[back])
        assert reply.meta == {"n": seq} and bytes(back) == data.tobytes()   # the bytes the server sent
        request = end.recv_frame(LIMITS, pool)
        assert (request.kind, request.seq, request.ack) == (MsgKind.REQUEST, seq, seq - 1)
        request.release()
        # the answers the client said it read are gone; the one it read since is kept until the next says so
        assert [a for a, _, _ in end.answers] == [seq] and end.kept == end.answers[0][2]
    assert end.read_upto == 39 and end.lost_upto == 0


def test_a_resume_that_asks_for_answers_the_client_said_it_had_read_is_refused_naming_the_seq(session):
    conn, end = session
    end.read_upto = 5
    assert end._refusal({"resume": "x", "received": 5}) is None
    why = end._refusal({"resume": "x", "received": 3})
    assert "seq 5" in why and "after seq 3" in why


class _ShortWrites:
    """A socket that takes at most ``step`` bytes a call (a full socket buffer, again and again)."""

    def __init__(self, step: int):
        self.step, self.got, self.calls = step, bytearray(), 0

    def sendmsg(self, parts, ancillary=(), flags=0):
        self.calls += 1
        left = self.step
        for p in parts:
            b = bytes(memoryview(p).cast("B"))[:left]
            self.got += b
            left -= len(b)
            if not left:
                break
        return self.step - left

    def recv_into(self, view, nbytes=0, flags=0):
        raise AssertionError("not read")


@pytest.mark.parametrize("step", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("kinds", ["bytes and byte views", "any buffer"])
def test_a_send_cut_short_anywhere_goes_on_at_the_byte_it_stopped(step, kinds):
    rng = np.random.default_rng(step)
    floats = rng.standard_normal(33).astype(np.float32)
    parts = [b"head" * 9, memoryview(rng.bytes(100)), b"", as_bytes_view(floats), memoryview(rng.bytes(3))]
    if kinds == "any buffer":       # (a bytearray, a view of floats: the general walk)
        parts[2:2] = [bytearray(rng.bytes(50)), memoryview(floats)]
    want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    sock = _ShortWrites(step)
    TcpTransport(sock).send(parts)
    assert bytes(sock.got) == want


def test_a_send_of_bytes_and_byte_views_that_fits_is_one_call():
    sock = _ShortWrites(1 << 20)
    data = np.arange(64, dtype=np.uint8)
    TcpTransport(sock).send([b"prefix", as_bytes_view(data), b"x"])
    assert sock.calls == 1 and bytes(sock.got) == b"prefix" + data.tobytes() + b"x"


def test_a_non_contiguous_view_is_refused_as_before():
    with pytest.raises(TypeError, match="C-contiguous"):
        TcpTransport(_ShortWrites(64)).send([b"p", memoryview(bytearray(10))[::2]])


def test_readable_on_a_closed_connection_says_it_is_lost_not_a_value_error():
    """A resume looks for the server's BYE on the old connection, which another thread may have closed already."""
    import socket as _socket

    from rgpu.errors import ConnectionLost
    from rgpu.transport.tcp import TcpTransport

    a, b = _socket.socketpair()
    t = TcpTransport(a)
    t.close()
    b.close()
    with pytest.raises(ConnectionLost, match="closed"):
        t.readable(0)
