"""The transport contract, the same cases for every transport: tcp, shm, ucx (where UCXX is installed).

send(parts) with parts from frame_parts or plain encode_prefix parts, send_meta; recv_frame(limits, pool, into);
readable; close; abort; the declared Capabilities and the base verbs behind them, and no caller that probes a
transport for attributes instead. Last, through a real server: a killed client's worker ends.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import clean_env, pid_gone, wait_until
from rgpu.errors import ConnectionLost, ProtocolError
from rgpu.transport.base import Capabilities, Transport
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view, encode_prefix, pack_meta
from transport_pairs import NAMES, pair, skip_reason

MiB = 1 << 20
LIMITS = Limits()


@pytest.fixture(params=NAMES)
def ends(request):
    why = skip_reason(request.param)
    if why:
        pytest.skip(why)
    with pair(request.param) as p:
        yield p


def send(t, kind, seq, meta=None, bufs=(), ack=0):
    """Send on a thread, as the peer is another process: a big send may wait for the receiver (ucx)."""
    parts = t.frame_parts(kind, seq, ack, meta, [as_bytes_view(b) for b in bufs])  # memoryviews, as a connection passes
    return in_thread(lambda: t.send(parts))


def recv(t, pool=None, into=None, limits=LIMITS):
    return t.recv_frame(limits, pool or BufferPool(), into)


def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def in_thread(fn):
    """Run ``fn`` on a thread; returns a callable giving its result or raising its exception."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc
    th = threading.Thread(target=run, daemon=True)
    th.start()

    def result(timeout=60):
        th.join(timeout)
        assert not th.is_alive(), "the thread is still blocked"
        if "error" in box:
            raise box["error"]
        return box.get("value")
    return result


def test_a_frame_arrives_whole_with_its_metadata_and_every_buffer(ends):
    client, server = ends
    sizes = [0, 1, 100, 16 << 10, (16 << 10) + 1, 300 << 10, 3 * MiB]
    bufs = [pattern(n, i) for i, n in enumerate(sizes)]
    meta = {"op": "x", "nested": [1, 2.5, None, True, b"raw", "text"]}
    sent = send(client, MsgKind.REQUEST, 7, meta, bufs, ack=3)
    frame = recv(server)
    sent()
    assert (frame.kind, frame.seq, frame.ack, frame.meta) == (MsgKind.REQUEST, 7, 3, meta)
    assert [b.nbytes for b in frame.buffers] == sizes
    for got, want in zip(frame.buffers, bufs):
        assert np.array_equal(np.frombuffer(got, np.uint8), want)
    frame.release()
    frame.release()  # twice is harmless


def test_frames_joined_in_one_send_arrive_in_order(ends):
    client, server = ends
    parts = []
    for i in range(60):
        parts += client.frame_parts(MsgKind.POST, i + 1, 0, {"i": i}, [as_bytes_view(pattern(i * 997, i))])
    sent = in_thread(lambda: client.send(parts))
    pool = BufferPool()
    for i in range(60):
        f = recv(server, pool)
        assert (f.seq, f.meta) == (i + 1, {"i": i})
        assert np.array_equal(np.frombuffer(f.buffers[0], np.uint8), pattern(i * 997, i))
        f.release()
    sent()


def test_plain_parts_of_several_frames_mean_the_same_to_every_transport(ends):
    """send(parts) means one thing: whole frames, each an encode_prefix prefix and its buffers (what a
    connection's lone call and the handshake send), joined; shm and ucx take them as tcp does."""
    client, server = ends
    bufs = [[], [as_bytes_view(pattern(100, 1))], [as_bytes_view(pattern(40 << 10, 2)), as_bytes_view(b"")]]
    parts = []
    for seq, views in enumerate(bufs, 1):
        parts += [encode_prefix(MsgKind.POST, seq, 0, pack_meta({"seq": seq}), [v.nbytes for v in views]), *views]
    sent = in_thread(lambda: client.send(parts))
    for seq, views in enumerate(bufs, 1):
        f = recv(server)
        assert (f.kind, f.seq, f.meta) == (MsgKind.POST, seq, {"seq": seq})
        assert [bytes(b) for b in f.buffers] == [bytes(v) for v in views]
        f.release()
    sent()


def test_every_transport_declares_what_it_can_do_and_the_base_verbs_answer_for_the_rest(ends):
    client, server = ends
    for t in (client, server):
        caps = t.capabilities
        assert isinstance(caps, Capabilities)
        assert not (caps.writes_inline and caps.batch_window_s is not None), caps   # one batching policy
        assert caps.resumable == (t.name == "tcp"), caps
        assert caps.names_shared_memory == t.name.startswith("shm"), caps
        assert not t.names(id(t), 1 << 20)      # nothing is named before the layer above says where memory is
        t.settle()                              # nothing named: nothing to do, on every transport
        assert t.share_memory(lambda addr, n: None) == caps.names_shared_memory
        assert not t.names(id(t), 1 << 20)      # a finder that places nothing: copied
    send(client, MsgKind.POST, 1, "still works")()
    assert recv(server).meta == "still works"


PROBE = re.compile(r"""(getattr|hasattr)\([^)\n]*transport[^)\n]*\)|transport(_name)?\.name\s*[!=]=|\.transport\.find_shared""")


def test_no_caller_probes_a_transport_for_attributes_or_by_name():
    """Callers read ``capabilities`` and call the base verbs; a probe would hide part of a transport's contract."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for folder in ("transport", "device_backend", "server", "cuda_intercept", "rgpu"):
        for path in sorted((root / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if PROBE.search(line) and "a report naming what it found" not in line:
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    assert {"send", "recv_frame", "close"} <= Transport.__abstractmethods__


def test_packed_metadata_alone_arrives_as_a_frame_small_or_too_big_for_one_record(ends):
    client, server = ends
    small, big = {"op": [1, 2.5, None]}, {"blob": bytes(600 << 10)}   # big: past shm's largest ring record
    for seq, meta in ((5, small), (6, big), (7, small)):
        sent = in_thread(lambda seq=seq, meta=meta: client.send_meta(MsgKind.POST, seq, pack_meta(meta)))
        frame = recv(server)
        sent()
        assert (frame.kind, frame.seq, frame.meta, frame.buffers) == (MsgKind.POST, seq, meta, [])
        frame.release()


def test_packed_metadata_with_buffers_arrives_as_sent_and_the_caller_may_change_them_at_once(ends):
    """send_meta's buffers are copied before it returns (a small upload's bytes, posted from C++)."""
    client, server = ends
    for seq, n in ((1, 100), (2, 128 << 10), (3, 600 << 10)):     # in a record, a big one, past any record
        buf = np.full(n, seq, np.uint8)
        sent = in_thread(lambda seq=seq, buf=buf: client.send_meta(MsgKind.POST, seq, pack_meta([seq]), [buf]))
        frame = recv(server)
        sent()
        buf[:] = 0
        assert (frame.kind, frame.seq, frame.meta) == (MsgKind.POST, seq, [seq])
        assert [b.nbytes for b in frame.buffers] == [n] and np.all(np.frombuffer(frame.buffers[0], np.uint8) == seq)
        frame.release()


def test_the_sender_may_change_its_buffers_once_send_returns(ends):
    client, server = ends
    for n in (64, 1 * MiB):
        buf = np.full(n, 5, np.uint8)
        sent = send(client, MsgKind.POST, 1, None, [buf])
        f = recv(server)
        sent()
        buf[:] = 9
        assert np.all(np.frombuffer(f.buffers[0], np.uint8) == 5)
        f.release()
        if n == 64:   # small: send has returned before anything was read; change it, send again
            buf = np.full(n, 5, np.uint8)
            client.send(client.frame_parts(MsgKind.POST, 2, 0, None, [as_bytes_view(buf)]))
            buf[:] = 9
            f = recv(server)
            assert np.all(np.frombuffer(f.buffers[0], np.uint8) == 5)
            f.release()


def test_buffers_land_in_caller_memory_when_the_sizes_match_and_in_the_pool_otherwise(ends):
    client, server = ends
    src = [pattern(1000, 1), pattern(2 * MiB, 2)]
    dest = [np.zeros(1000, np.uint8), np.zeros(2 * MiB, np.uint8)]
    sent = send(server, MsgKind.REPLY, 5, None, src)
    f = recv(client, into=lambda kind, seq, lengths: [memoryview(d) for d in dest])
    sent()
    assert all(b.obj is d for b, d in zip(f.buffers, dest))
    assert all(np.array_equal(d, s) for d, s in zip(dest, src))
    f.release()
    sent = send(server, MsgKind.REPLY, 6, None, [pattern(10)])       # not the size the caller prepared
    f = recv(client, into=lambda kind, seq, lengths: [memoryview(np.zeros(11, np.uint8))])
    sent()
    assert bytes(f.buffers[0]) == pattern(10).tobytes()
    f.release()


def test_big_buffers_cross_both_ways_intact(ends):
    client, server = ends
    big = pattern(64 * MiB, 3)
    sent = send(client, MsgKind.REQUEST, 1, None, [big])
    f = recv(server)
    sent()
    sent = send(server, MsgKind.REPLY, 1, None, f.buffers)     # echo straight from what arrived
    back = recv(client)
    sent()
    f.release()
    assert np.array_equal(np.frombuffer(back.buffers[0], np.uint8), big)
    back.release()


def test_numpy_arrays_of_any_dtype_go_as_their_bytes(ends):
    client, server = ends
    arrays = [np.arange(1000, dtype=np.float32), np.arange(30000, dtype=np.int64).reshape(100, 300)[:, ::2]]
    sent = send(client, MsgKind.POST, 1, None, arrays)
    f = recv(server)
    sent()
    assert bytes(f.buffers[0]) == arrays[0].tobytes()
    assert bytes(f.buffers[1]) == np.ascontiguousarray(arrays[1]).tobytes()
    f.release()


def test_frames_flow_both_ways_at_once(ends):
    client, server = ends
    n = 200

    def sender(t, tag):
        for i in range(n):
            t.send(t.frame_parts(MsgKind.POST, i + 1, 0, tag, [as_bytes_view(pattern((i % 7) * 20000, i))]))

    def receiver(t, tag):
        pool = BufferPool()
        for i in range(n):
            f = recv(t, pool)
            assert (f.seq, f.meta) == (i + 1, tag)
            assert np.array_equal(np.frombuffer(f.buffers[0], np.uint8), pattern((i % 7) * 20000, i))
            f.release()
    waits = [in_thread(lambda: sender(client, "c")), in_thread(lambda: sender(server, "s")),
             in_thread(lambda: receiver(server, "c")), in_thread(lambda: receiver(client, "s"))]
    for w in waits:
        w()


def test_a_frame_beyond_the_receivers_limits_is_a_protocol_error(ends):
    client, server = ends
    sent = send(client, MsgKind.POST, 1, None, [b"a"] * 5)
    with pytest.raises(ProtocolError, match="nbufs"):
        recv(server, limits=Limits(max_buffers=2))
    sent()


def test_metadata_beyond_the_limit_is_a_protocol_error(ends):
    client, server = ends
    sent = send(client, MsgKind.POST, 1, "m" * 5000)
    with pytest.raises(ProtocolError, match="meta_len"):
        recv(server, limits=Limits(max_meta_bytes=1000))
    sent()


ENDINGS = {"the peer closes": lambda client, server: server.close(),
           "its own end aborts": lambda client, server: client.abort()}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_thread_blocked_in_receive_gets_connection_lost_when(ends, ending):
    client, server = ends
    waiting = in_thread(lambda: recv(client))
    ENDINGS[ending](client, server)
    with pytest.raises(ConnectionLost):
        waiting()


def test_frames_sent_before_the_peer_closed_are_still_delivered(ends):
    client, server = ends
    send(server, MsgKind.REPLY, 1, "last words")()
    server.close()
    f = recv(client)
    assert f.meta == "last words"
    with pytest.raises(ConnectionLost):
        recv(client)


def test_sending_after_close_is_connection_lost(ends):
    client, _ = ends
    client.close()
    with pytest.raises(ConnectionLost):
        send(client, MsgKind.POST, 1)()


def test_readable_says_whether_a_frame_is_waiting(ends):
    client, server = ends
    assert not server.readable(0.05)
    send(client, MsgKind.POST, 1, "here")()
    assert server.readable(10)
    assert recv(server).meta == "here"


# ---- through a real server --------------------------------------------------------------------

CLIENT = """
import sys, time
from rgpu import config
from rgpu.transport.client import connect
conn = connect("echo", settings=config.settings(environ={}, server=sys.argv[1], token=sys.argv[2],
                                                transport=sys.argv[3]))
conn.call({"op": "echo"}, [b"x" * (4 << 20)]).release()
print(conn.transport_name, conn.welcome["info"]["pid"], flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("name", ["shm", "ucx"])  # the two that notice a dead peer by means of their own
def test_a_killed_client_ends_its_worker(start_server, name):
    why = skip_reason(name)
    if why:
        pytest.skip(why)
    server = start_server()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.address, server.token, name],
                              stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        got, pid = client.stdout.readline().split()
        assert got == name
        client.kill()
        wait_until(lambda: pid_gone(int(pid)), 30, f"the worker of a killed {name} client to exit")
    finally:
        client.kill()
        client.wait()
