"""Sessions outlive a dropped tcp connection: a proxy cuts the stream while a model trains, and the session
resumes with nothing lost or applied twice; past the grace or the replay bound the client gets SessionLost
naming why, and the server frees the session.

The model is the least-squares fit of ``test_resilience_killed`` (aten ops over the ops route, checked
against the same ops on the CPU here), and an upload big enough to be written before ``post()`` returns.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from rgpu.errors import AuthenticationError, SessionLost
from rgpu.protocol.ops import DTYPES, Msg
from rgpu.transport import handshake, tcp
from rgpu.transport.client import connect
from rgpu.transport.resume import ResumingTransport
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import Limits, MsgKind

from conftest import wait_until
from session_proxy import Cut, CuttingProxy
from test_resilience_killed import Trainer

F32 = DTYPES.index("float32")
BIG = 1 << 20                 # floats: a 4 MiB upload, past RGPU_POST_COPY_BYTES (written before post() returns)
SERVE = ("--device", "cpu", "--spare-workers", "1")


def _workers(server) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _through(proxy, server, **overrides):
    return connect("ops", settings=server.settings(**overrides).with_(server=proxy.address))


def _big_desc(sid: int) -> list:
    return [sid, 4 * BIG, F32, [BIG], [1], 0, 0]


def _run(conn, steps: int = 24) -> list[torch.Tensor]:
    """Train; the weights every 4 steps, and the big upload's bytes back, as the record of the run."""
    trainer = Trainer(conn)
    record = []
    big = np.arange(BIG, dtype=np.float32)
    for i in range(steps):
        trainer.step()
        if i == steps // 2:
            conn.post([Msg.UPLOAD, [], _big_desc(9000)], [big])
            back = conn.call([Msg.DOWNLOAD, [], _big_desc(9000)])
            record.append(torch.frombuffer(bytearray(back.buffers[0]), dtype=torch.float32).clone())
            back.release()
        if i % 4 == 3:
            record.append(trainer.weights())
    assert torch.equal(trainer.weights(), trainer.reference())
    return record


@pytest.fixture
def server(start_server):
    return start_server(*SERVE, env={"RGPU_SESSION_GRACE": "30"})


def test_training_through_cuts_mid_frame_mid_upload_and_before_a_reply_matches_an_uncut_run(server):
    uncut = _run(server.connect("ops"))
    cuts = {0: Cut("up", offset=2500),                                  # mid-frame, early in training
            1: Cut("up", kind=MsgKind.POST, min_bytes=BIG, fraction=0.5),   # mid-upload
            2: Cut("down", kind=MsgKind.WELCOME, fraction=0.5),         # the resume's own handshake: tried again
            3: Cut("down", kind=MsgKind.REPLY, min_bytes=BIG, fraction=0.3),   # mid-download
            4: Cut("down", kind=MsgKind.REPLY, nth=2)}                  # applied, its reply never read
    proxy = CuttingProxy((server.host, server.port), cuts)
    try:
        conn = _through(proxy, server)
        assert isinstance(conn.transport, ResumingTransport)
        cut = _run(conn)
        assert len(proxy.cuts_done) == 5, proxy.cuts_done
        assert conn.transport.resumes == 4
        assert len(cut) == len(uncut) and all(torch.equal(a, b) for a, b in zip(cut, uncut))
        conn.close()
    finally:
        proxy.close()
    assert "Traceback" not in server.stderr


def test_random_cuts_of_either_direction_leave_the_weights_bit_identical(server):
    uncut = _run(server.connect("ops"))
    rng = np.random.default_rng(25)   # a step posts ~1 KB up; down, a reply of ~100 B every 4 steps
    cuts = {i: Cut("up", offset=int(rng.integers(200, 3000))) if i % 2 else
            Cut("down", offset=int(rng.integers(1, 400))) for i in range(6)}
    proxy = CuttingProxy((server.host, server.port), cuts)
    try:
        conn = _through(proxy, server)
        cut = _run(conn)
        assert all(torch.equal(a, b) for a, b in zip(cut, uncut))
        assert conn.transport.resumes == len(proxy.cuts_done) >= 4, proxy.cuts_done
        conn.close()
    finally:
        proxy.close()


def test_a_connection_that_died_silently_on_the_servers_side_is_taken_over_by_the_resume(server):
    uncut = _run(server.connect("ops"), steps=8)
    proxy = CuttingProxy((server.host, server.port), {0: Cut("up", offset=3000, silent=True)})
    try:
        conn = _through(proxy, server)
        cut = _run(conn, steps=8)                 # the worker, reading a connection that says nothing, lets
        assert all(torch.equal(a, b) for a, b in zip(cut, uncut))   # it go for the resumed one
        assert conn.transport.resumes == 1 and proxy.cuts_done
        conn.close()
    finally:
        proxy.close()


def test_past_the_grace_the_client_gets_session_lost_and_the_server_frees_the_session(start_server):
    server = start_server(*SERVE, env={"RGPU_SESSION_GRACE": "1.5"})
    baseline = _workers(server)
    proxy = CuttingProxy((server.host, server.port), {0: Cut("down", kind=MsgKind.REPLY, nth=2)})
    try:
        conn = _through(proxy, server)
        trainer = Trainer(conn)
        trainer.step()
        assert len(_workers(server)) == len(baseline) + 1     # the session's worker (a spare replaced it)
        proxy.refusing = True                                 # the server is out of reach from now on
        started = time.monotonic()
        with pytest.raises(SessionLost, match="grace of 1.5 s"):
            for _ in range(3):
                trainer.weights()
        assert time.monotonic() - started < 10                # never a hang
        with pytest.raises(SessionLost):                      # and every later wait says so again
            trainer.weights()
    finally:
        proxy.close()
    # past its grace the worker ends: the session's handle table and memory go with its process
    wait_until(lambda: len(_workers(server)) <= len(baseline), 15, "the session's worker to end")


def test_a_server_killed_outright_is_a_session_lost_within_the_grace(start_server):
    server = start_server(*SERVE, env={"RGPU_SESSION_GRACE": "2"})
    conn = server.connect("ops")
    trainer = Trainer(conn)
    trainer.step()
    os.killpg(server.proc.pid, signal.SIGKILL)       # the acceptor and its workers, at once
    server.proc.wait()
    started = time.monotonic()
    with pytest.raises(SessionLost, match="grace of 2 s.*cannot connect"):
        trainer.weights()
    assert time.monotonic() - started < 8


def test_past_the_replay_bound_a_drop_ends_the_session_with_the_reason(start_server):
    server = start_server(*SERVE, env={"RGPU_SESSION_GRACE": "30"})
    proxy = CuttingProxy((server.host, server.port), {0: Cut("up", kind=MsgKind.POST, min_bytes=BIG, fraction=0.5)})
    try:
        conn = _through(proxy, server, replay_bytes=1 << 20)   # the 4 MiB upload cannot be kept
        Trainer(conn).step()
        conn.post([Msg.UPLOAD, [], _big_desc(9000)], [np.zeros(BIG, dtype=np.float32)])
        with pytest.raises(SessionLost, match="RGPU_REPLAY_BYTES"):
            conn.call([Msg.MEMORY, 0])
    finally:
        proxy.close()


def test_a_long_stretch_of_posts_is_acknowledged_so_the_replay_log_stays_within_its_bound(server):
    proxy = CuttingProxy((server.host, server.port), {0: Cut("up", offset=3_000_000)})
    try:
        conn = _through(proxy, server, replay_bytes=1 << 20)
        trainer = Trainer(conn)
        chunk = np.ones(16 << 10, dtype=np.float32)              # 64 KiB a post: 8 MiB in all, no request
        for sid in range(5000, 5128):
            conn.post([Msg.UPLOAD, [], [sid, chunk.nbytes, F32, [chunk.size], [1], 0, 0]], [chunk])
        log = conn.transport.log
        assert log.nbytes <= log.bound and log.gap == 0          # the server's acknowledgements were read
        trainer.step()
        assert torch.equal(trainer.weights(), trainer.reference())
        assert conn.transport.resumes == 1 and proxy.cuts_done
        held = conn.call([Msg.MEMORY, 0]).meta[0]
        assert held >= 128 * chunk.nbytes                       # every upload applied once, none twice
    finally:
        proxy.close()


def _resume_hello(server, token: bytes, options: dict) -> dict:
    t = TcpTransport(tcp.connect(server.host, server.port, 5.0))
    try:
        hello = handshake.Hello(route="ops", session="s-resume", versions={}, transports=[], options=options)
        return handshake.client_handshake(t, token, hello, Limits())
    finally:
        t.close()


def test_a_resume_with_a_wrong_id_or_another_token_is_refused(server):
    conn = server.connect("ops")
    offer = conn.welcome["resume"]
    assert len(offer["id"]) >= 32 and offer["grace_s"] == 30
    with pytest.raises(SessionLost, match="no session to resume"):
        _resume_hello(server, server.token.encode(), {"resume": offer["id"][:-1] + "x", "received": 0})
    with pytest.raises(AuthenticationError):
        _resume_hello(server, b"another-token", {"resume": offer["id"], "received": 0})
    with pytest.raises(SessionLost, match="no session to resume"):      # the id is bound to its session's name
        _resume_hello(server, server.token.encode(), {"resume": offer["id"], "received": 0})
    assert conn.call([Msg.MEMORY, 0]).meta[0] == 0                     # the session itself goes on, untouched


@pytest.mark.skipif(not os.path.exists("/dev/shm"), reason="shm needs /dev/shm")
def test_over_shm_nothing_changes(server):
    conn = server.connect("ops", transport="auto")
    if conn.transport_name != "shm":
        pytest.skip(f"shm not negotiated here ({conn.transport_name})")
    assert not isinstance(conn.transport, ResumingTransport)


def test_a_cuda_route_program_copies_through_cut_connections_unchanged(start_server):
    server = start_server("--cuda-driver", "fake", "--spare-workers", "1", env={"RGPU_SESSION_GRACE": "30"})
    cuts = {0: Cut("up", offset=40_000),                                  # mid-copy
            1: Cut("down", kind=MsgKind.REPLY, nth=5),                    # a call applied, its answer not read
            2: Cut("down", kind=MsgKind.REPLY, min_bytes=1 << 16, fraction=0.5)}   # mid-download
    proxy = CuttingProxy((server.host, server.port), cuts)
    try:
        conn = connect("cuda", settings=server.settings().with_(server=proxy.address))

        def call(op, ctx, *args, buffers=()):
            reply = conn.call([op, ctx, *args], list(buffers))
            code, value, _ = reply.meta
            assert code == 0, (op, value)
            return value, reply

        call("init", 0, 0)
        ctx, _ = call("primary_ctx_retain", 0, 0)
        ptr, _ = call("mem_alloc", ctx, 1 << 16)
        rng = np.random.default_rng(6)
        for _ in range(24):
            data = rng.integers(0, 255, 1 << 16, dtype=np.uint8).tobytes()
            call("memcpy_htod", ctx, ptr, None, buffers=[data])
            _, reply = call("memcpy_dtoh", ctx, ptr, 1 << 16, None)
            assert bytes(reply.buffers[0]) == data
            reply.release()
        call("mem_free", ctx, ptr)
        assert conn.transport.resumes == len(proxy.cuts_done) == 3, proxy.cuts_done
        conn.close()
    finally:
        proxy.close()
