"""shm's per-message calls in C (transport/shm_native.c): the server's frame loop in the ring (the lone call:
test_shm_lone.py).

The worker's loop runs each message sequence twice, on a server end with the C loop and on one without
(the Python path, the reference): the client must read the same frames from both, value by value, and
whatever the C loop leaves alone (a BYE, heap buffers, undecodable or timestamp metadata, an answer it
cannot put, an op that raises) must end as the Python path ends it.
"""
from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rgpu import config
from rgpu.errors import ProtocolError
from rgpu.server import worker
from rgpu.server import echo
from rgpu.server.route import Session
from rgpu.transport import shm, shm_fast
from rgpu.transport.shm_native import SERVE_IDLE
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view
from transport_pairs import shm_pair

pytestmark = pytest.mark.skipif(shm.available() is not None or shm_fast.load() is None,
                                reason=str(shm.available() or f"shm's C path: {shm_fast.why_not()}"))

LIMITS = Limits()
SESSION = Session(id="test", route="echo", settings=config.settings(environ={}))


def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Recording(echo.Executor):
    """The echo route, remembering what reached it; ``big`` answers with a buffer too big for the ring
    alone, ``weird`` with metadata msgpack cannot encode, ``array`` with a buffer that is a numpy array."""

    def __init__(self):
        super().__init__(SESSION)
        self.seen = []

    def handle(self, meta, buffers, reply):
        self.seen.append((meta, [bytes(b) for b in buffers], reply))
        op = meta.get("op") if isinstance(meta, dict) else None
        if op == "big":
            return {"n": 1}, [pattern(3 << 20, 7)]
        if op == "weird":
            return {"not encodable": object()}, []
        if op == "array":
            return {"n": 2}, [pattern(100, 8)]
        return super().handle(meta, buffers, reply)


def run_session(frames: list, server_c: bool) -> tuple[list, list, BaseException | None]:
    """``frames`` (kind, meta, buffers, raw meta or None) sent to the worker's loop on a server end with or
    without the C path: (what the client read, what the executor saw, what ended the loop if not a BYE)."""
    client, server = shm_pair(True, server_c)
    executor, ended = Recording(), []
    assert (server.serve is not None) == server_c

    def loop():
        try:
            worker._loop(server, executor, SESSION, LIMITS, BufferPool())
        except BaseException as exc:   # noqa: BLE001 - what the test compares
            ended.append(exc)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    try:
        for seq, (kind, meta, bufs, raw) in enumerate(frames, 1):
            if raw is None:
                client.send(client.frame_parts(kind, seq, 0, meta, [as_bytes_view(b) for b in bufs]))
            else:
                client.send_meta(kind, seq, raw)
        th.join(20)
        assert not th.is_alive(), "the server's loop did not end"
        got = []
        while client.readable(0.2):
            f = client.recv_frame(LIMITS, BufferPool())
            got.append((f.kind, f.seq, f.ack, f.meta, [bytes(b) for b in f.buffers]))
            f.release()
        return got, executor.seen, (ended[0] if ended else None)
    finally:
        client.close()
        server.close()


def same_on_both_paths(frames: list):
    fast, slow = run_session(frames, True), run_session(frames, False)
    assert fast[:2] == slow[:2]
    assert type(fast[2]) is type(slow[2]) and str(fast[2]) == str(slow[2])
    return fast


REQ, POST, BYE = MsgKind.REQUEST, MsgKind.POST, MsgKind.BYE


def test_posts_and_requests_run_in_order_with_the_same_answers():
    frames = [(POST, {"op": "note", "v": 1}, [], None),
              (REQ, {"op": "echo"}, [pattern(64, 1), pattern(3, 2)], None),
              (POST, {"op": "note", "v": [-1, "x"]}, [pattern(10)], None),
              (REQ, {"op": "notes"}, [], None),
              (REQ, None, [], None),                                   # no metadata at all: the op fails
              (REQ, {"op": "echo"}, [], None),
              (BYE, None, [], None)]
    got, seen, ended = same_on_both_paths(frames)
    assert ended is None and len(seen) == 6
    assert [g[:3] for g in got] == [(MsgKind.REPLY, 2, 2), (MsgKind.REPLY, 4, 4), (MsgKind.ERROR, 5, 4),
                                    (MsgKind.REPLY, 6, 6)]
    assert got[0][4] == [pattern(64, 1).tobytes(), pattern(3, 2).tobytes()] and got[0][3] == {"posts": 1}
    assert got[1][3] == {"notes": [1, [-1, "x"]]}


def test_a_failing_post_and_request_answer_with_errors_naming_the_last_applied():
    frames = [(POST, {"op": "fail", "message": "post went wrong"}, [], None),
              (REQ, {"op": "echo"}, [], None),
              (REQ, {"op": "fail", "message": "request went wrong"}, [], None),
              (BYE, None, [], None)]
    got, _, ended = same_on_both_paths(frames)
    assert ended is None
    assert [(g[0], g[1], g[2]) for g in got] == [(MsgKind.ERROR, 1, 0), (MsgKind.REPLY, 2, 2), (MsgKind.ERROR, 3, 2)]
    assert got[0][3]["message"] == "post went wrong" and got[2][3]["type"] == "OpFailed"


def test_answers_the_ring_cannot_take_go_the_python_way():
    frames = [(REQ, {"op": "big"}, [], None),          # 3 MiB: through the heap
              (REQ, {"op": "weird"}, [], None),        # not encodable: the executor's failure
              (REQ, {"op": "array"}, [], None),
              (BYE, None, [], None)]
    got, _, ended = same_on_both_paths(frames)
    assert ended is None
    assert got[0][4] == [pattern(3 << 20, 7).tobytes()] and got[2][4] == [pattern(100, 8).tobytes()]
    assert got[1][0] is MsgKind.ERROR and "the reply cannot be sent" in got[1][3]["message"]


def test_frames_the_c_loop_leaves_alone_are_read_by_the_python_path():
    big = pattern(2 << 20, 3)                          # heap buffers: a lease the loop cannot hold
    in_a_string = {"op": "echo", "s": "\xd6\xff"}      # a timestamp's bytes inside a string: fine
    frames = [(REQ, {"op": "echo"}, [big], None),
              (REQ, in_a_string, [], None),
              (REQ, {"op": "echo"}, [], None),
              (BYE, None, [], None)]
    got, seen, ended = same_on_both_paths(frames)
    assert ended is None and got[0][4] == [big.tobytes()] and seen[1][0] == in_a_string
    assert [g[1] for g in got] == [1, 2, 3]


@pytest.mark.parametrize("raw, message", [
    (b"\xc1", "undecodable msgpack"),
    (msgpack.packb({"t": msgpack.Timestamp(1, 0)}), "timestamp"),
    (msgpack.packb(msgpack.ExtType(5, b"x")), "extension type 5"),
], ids=["undecodable", "a timestamp", "an extension"])
def test_metadata_the_server_refuses_ends_the_session_naming_it_on_both_paths(raw, message):
    frames = [(REQ, {"op": "echo"}, [], None), (REQ, None, [], raw), (REQ, {"op": "echo"}, [], None)]
    got, seen, ended = same_on_both_paths(frames)
    assert isinstance(ended, ProtocolError) and message in str(ended)
    assert [g[1] for g in got] == [1] and len(seen) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=4))
def test_garbage_metadata_ends_alike_on_both_paths_and_never_crashes(metas):
    frames = [(POST if i % 2 else REQ, None, [], raw) for i, raw in enumerate(metas)] + [(BYE, None, [], None)]
    same_on_both_paths(frames)



def test_a_server_whose_c_loop_spun_for_nothing_sleeps_at_once_in_recv_frame(shm_ends):
    """The C loop's wait already spun: the wait that follows goes to sleep without spinning a second time."""
    client, server = shm_ends
    server.spin_s = 0.002
    assert server.serve(lambda *args: None, 0, LIMITS)[0] == SERVE_IDLE
    spins, wait = [], server.waits.c_wait
    server.waits.c_wait = lambda ring, head, busy, spin, yield_core: spins.append(spin) or wait(ring, head, busy, spin,
                                                                                         yield_core)
    for seq in (1, 2):
        post = client.frame_parts(POST, seq, 0, {"op": "note"}, [])
        threading.Timer(0.05, client.send, (post,)).start()
        assert server.recv_frame(LIMITS, BufferPool()).seq == seq
    assert spins[0] == 0.0 and spins[1] > 0.001      # the second wait, after a frame, spins as usual
