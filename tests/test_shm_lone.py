"""A connection's lone call over shm in C (transport/shm_lone.c) against its Python reference.

Every case runs on both: the connection's ``_lone`` as shm's C path builds it (``LoneCall``) and as
``Connection._call_alone`` (the Python reference, every other transport's path). Each must give the
same answers, errors, stats and frames at the server, value by value; a hypothesis test runs random
sequences of calls and answers on both and compares everything that came back.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rgpu import config
from rgpu.errors import ConnectionLost, ProtocolError, RemoteError
from rgpu.transport import shm, shm_fast
from rgpu.transport.connection import Connection
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view
from transport_pairs import shm_pair

pytestmark = pytest.mark.skipif(shm.available() is not None or shm_fast.load() is None,
                                reason=str(shm.available() or f"shm's C path: {shm_fast.why_not()}"))

LIMITS = Limits()
PATHS = ["C", "Python"]


def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def connection(path: str):
    """A Connection over a fresh shm pair (both ends on the C path), its lone call on ``path``; the server end."""
    client, server = shm_pair()
    conn = Connection(client, config.settings(environ={}))
    assert type(conn._lone).__name__ == "LoneCall"
    if path == "Python":
        conn._lone = conn._call_alone
    return conn, server


@pytest.fixture(params=PATHS)
def lone(request):
    conn, server = connection(request.param)
    yield conn, server
    conn.close(timeout=1)
    server.close()


def serve(server, n: int, answer, delay: float = 0.0, seen: list | None = None):
    """Answer ``n`` frames on a thread, each after ``delay``: ``answer(frame)`` -> (kind, meta, bufs), or None
    for a post; what arrived is appended to ``seen`` as (kind, seq, meta, [bytes])."""
    def run():
        for _ in range(n):
            f = server.recv_frame(LIMITS, BufferPool())
            if seen is not None:
                seen.append((f.kind, f.seq, f.meta, [bytes(b) for b in f.buffers]))
            time.sleep(delay)
            out = answer(f)
            if out is not None:
                kind, meta, bufs = out
                server.send(server.frame_parts(kind, f.seq, f.seq, meta, [as_bytes_view(b) for b in bufs]))
            f.release()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def echo(f):
    return (MsgKind.REPLY, {"seq": f.seq}, [bytes(b) for b in f.buffers]) if f.kind is MsgKind.REQUEST else None


def test_the_c_path_is_what_a_connection_over_shm_gets_and_rgpu_shm_c_0_is_not():
    client, server = shm_pair(False, False)
    try:
        assert Connection(client, config.settings(environ={}))._lone.__name__ == "_call_alone"
    finally:
        client.close()
        server.close()


def test_lone_calls_return_the_answers_into_place_and_count_alike(lone):
    conn, server = lone
    seen = []
    th = serve(server, 50, echo, seen=seen)
    back = memoryview(bytearray(32))
    for i in range(50):
        reply = conn.call({"i": i}, [pattern(32, i)], reply_into=[back])
        assert reply.meta == {"seq": i + 1} and bytes(back) == pattern(32, i).tobytes()
        assert len(reply.buffers) == 1 and bytes(reply.buffers[0]) == bytes(back)
        reply.release()
    th.join(10)
    assert seen == [(MsgKind.REQUEST, i + 1, {"i": i}, [pattern(32, i).tobytes()]) for i in range(50)]
    assert conn.stats == {"messages": 50, "round_trips": 50, "bytes_out": 50 * 32, "bytes_in": 50 * 32}


def test_sent_is_called_once_after_the_write_and_before_the_answer(lone):
    conn, server = lone
    marks = []
    th = serve(server, 2, echo, delay=0.2)
    for ring in (True, False):                # the ring's write in C (or Python), then the usual write
        buf = pattern(64, 1) if ring else pattern(1 << 20, 2)     # too big for the ring: exchange_alone
        t0 = time.monotonic()
        reply = conn.call({}, [buf], sent=lambda: marks.append(time.monotonic()))
        done = time.monotonic()
        assert len(marks) == 1 and marks.pop() - t0 < done - t0 - 0.15     # well before the answer came
        assert [bytes(b) for b in reply.buffers] == [buf.tobytes()]
        reply.release()
    th.join(10)


def test_a_reply_that_does_not_fit_the_target_comes_in_its_own_buffers(lone):
    conn, server = lone
    th = serve(server, 2, lambda f: (MsgKind.REPLY, {}, [b"abc", b"de"] if f.seq == 1 else [b"xyz"]))
    back = bytearray(8)
    two = conn.call({}, [], reply_into=[back])
    one = conn.call({}, [], reply_into=[back])
    th.join(10)
    assert [bytes(b) for b in two.buffers] == [b"abc", b"de"] and [bytes(b) for b in one.buffers] == [b"xyz"]
    assert back == bytes(8)


@pytest.mark.parametrize("bufs", [[], [pattern(10), pattern(20, 1)], [pattern(2 << 20, 2)]],
                         ids=["no buffer", "two buffers", "a heap buffer"])
def test_a_reply_after_the_spin_or_outside_the_ring_is_read_the_usual_way(lone, bufs):
    conn, server = lone
    conn.transport.spin_s = 0.0005
    th = serve(server, 1, lambda f: (MsgKind.REPLY, {"n": len(bufs)}, bufs), delay=0.05)
    reply = conn.call(None)
    th.join(10)
    assert reply.meta == {"n": len(bufs)} and [bytes(b) for b in reply.buffers] == [b.tobytes() for b in bufs]
    reply.release()


@pytest.mark.parametrize("buf", [pattern(1 << 20, 3), pattern(64, 4)[::2]], ids=["too big for the ring", "strided"])
def test_a_request_the_ring_does_not_take_is_sent_the_usual_way(lone, buf):
    conn, server = lone
    seen = []
    th = serve(server, 1, echo, seen=seen)
    reply = conn.call({"op": "up"}, [buf])
    th.join(10)
    assert seen == [(MsgKind.REQUEST, 1, {"op": "up"}, [buf.tobytes()])]
    assert bytes(reply.buffers[0]) == buf.tobytes() and conn.stats["bytes_out"] == buf.nbytes


def test_metadata_the_c_path_leaves_to_python_is_read_there(lone):
    conn, server = lone
    odd = {"s": "\xd7\xff"}                        # timestamp-like bytes: the Python path decides
    th = serve(server, 1, lambda f: (MsgKind.REPLY, odd, [pattern(8, 1)]))
    back = bytearray(8)
    reply = conn.call({"op": "echo"}, [pattern(8)], reply_into=[back])
    th.join(10)
    assert reply.meta == odd and bytes(reply.buffers[0]) == pattern(8, 1).tobytes()


def test_an_error_reply_and_an_earlier_posts_error_are_raised_at_the_call(lone):
    conn, server = lone
    error = {"message": "boom", "op": "x", "type": "ValueError"}
    th = serve(server, 4, lambda f: (MsgKind.ERROR, error, []) if f.meta.get("fail") else
               (MsgKind.REPLY, {"seq": f.seq}, []) if f.kind is MsgKind.REQUEST else None)
    with pytest.raises(RemoteError, match="boom"):
        conn.call({"fail": True})
    conn.post({"fail": True})               # its error comes back with no request waiting for it
    with pytest.raises(RemoteError, match="boom") as raised:
        conn.call({"fine": True})
    assert raised.value.op == "x"
    assert conn.call({"fine": True}).meta == {"seq": 4}     # the session goes on
    th.join(10)


def test_a_call_while_another_request_is_pending_goes_through_the_future(lone):
    conn, server = lone
    th = serve(server, 2, lambda f: (MsgKind.REPLY, {"seq": f.seq}, []))
    pending = conn.request({"first": True})
    reply = conn.call({"second": True})
    assert reply.meta == {"seq": pending.seq + 1} and pending.result(10).meta == {"seq": pending.seq}
    th.join(10)


def test_metadata_that_cannot_be_encoded_is_refused_before_anything_is_sent(lone):
    conn, server = lone
    with pytest.raises(ProtocolError, match="cannot encode"):
        conn.call({"x": object()})
    assert not server.readable(0) and conn.stats["messages"] == 0
    th = serve(server, 1, echo)
    assert conn.call({"x": 1}).meta == {"seq": 1}       # nothing was lost: the next call is the first
    th.join(10)


def test_a_target_that_cannot_take_the_reply_is_refused_before_anything_is_sent(lone):
    conn, server = lone
    with pytest.raises(TypeError, match="writable"):
        conn.call({}, [], reply_into=[bytes(8)])
    assert not server.readable(0)


def test_a_reply_to_a_request_never_made_ends_the_session(lone):
    conn, server = lone
    th = serve(server, 1, lambda f: None)
    server.send(server.frame_parts(MsgKind.REPLY, 99, 0, {}, []))
    with pytest.raises(ProtocolError, match="unknown request 99"):
        conn.call({})
    th.join(10)
    with pytest.raises(ProtocolError):
        conn.call({})


def test_a_closed_transport_fails_the_call_and_every_later_one(lone):
    conn, server = lone
    conn.transport.close()
    with pytest.raises(ConnectionLost):
        conn.call({}, [b"x"])
    with pytest.raises(ConnectionLost):
        conn.call({})


def test_calls_from_many_threads_each_get_their_own_answer(lone):
    conn, server = lone
    threads, calls = 4, 100
    th = serve(server, threads * calls, lambda f: (MsgKind.REPLY, f.meta, [bytes(b) for b in f.buffers]))
    wrong = []

    def run(t):
        for i in range(calls):
            reply = conn.call({"t": t, "i": i}, [pattern(16, t * calls + i)])
            if reply.meta != {"t": t, "i": i} or bytes(reply.buffers[0]) != pattern(16, t * calls + i).tobytes():
                wrong.append((t, i))
            reply.release()
    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    th.join(10)
    assert wrong == [] and conn.stats["round_trips"] == threads * calls


@pytest.mark.parametrize("path", PATHS)
def test_a_closed_connection_is_collected(path):
    conn, server = connection(path)
    gone = weakref.ref(conn)
    conn.close(timeout=1)
    server.close()
    del conn
    gc.collect()
    assert gone() is None


# ---- both paths side by side, on random sequences -------------------------------------------------

REPLIES = st.sampled_from(["reply", "error", "post error", "two buffers", "no buffer", "late"])
CALLS = st.lists(st.tuples(st.integers(0, 300), REPLIES, st.booleans()), min_size=1, max_size=8)


def run_calls(path: str, calls: list) -> list:
    """``calls`` (request bytes, how the server answers, whether there is a target) on ``path``: every
    outcome, what reached the server and the stats."""
    conn, server = connection(path)
    conn.transport.spin_s = 0.0005
    seen, out = [], []

    def answer(f):
        if f.kind is MsgKind.POST:
            return (MsgKind.ERROR, {"message": f"post {f.seq} failed"}, [])
        how = f.meta["how"]
        if how == "error":
            return (MsgKind.ERROR, {"message": f"call {f.seq} failed", "op": "t"}, [])
        if how == "late":
            time.sleep(0.005)
        bufs = {"two buffers": [b"ab", bytes(f.buffers[0]) if f.buffers else b""], "no buffer": []}.get(
            how, [bytes(f.buffers[0]) if f.buffers else b""])
        return (MsgKind.REPLY, {"seq": f.seq}, bufs)
    frames = sum(2 if how == "post error" else 1 for _, how, _ in calls)
    th = serve(server, frames, answer, seen=seen)
    try:
        for i, (n, how, target) in enumerate(calls):
            if how == "post error":
                conn.post({"i": i})
            back = bytearray(n) if target else None
            try:
                reply = conn.call({"i": i, "how": how}, [pattern(n, i)] if n else [],
                                  reply_into=None if back is None else [back])
                out.append(("reply", reply.meta, [bytes(b) for b in reply.buffers],
                            None if back is None else bytes(back)))
                reply.release()
            except RemoteError as exc:
                out.append(("error", str(exc), exc.op))
        th.join(10)
        return [out, seen, dict(conn.stats)]
    finally:
        conn.close(timeout=1)
        server.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CALLS)
def test_random_calls_come_back_the_same_on_both_paths(calls):
    assert run_calls("C", calls) == run_calls("Python", calls)
