"""A client connection against a real server: posts, requests, order, threads, errors, timeouts, backpressure."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from rgpu import config
from rgpu.errors import ConnectionLost, RemoteError, Timeout
from rgpu.transport import handshake, shm, tcp
from rgpu.transport.base import Capabilities
from rgpu.transport.client import connect
from rgpu.transport.connection import Future
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import Limits, MsgKind, encode_frame

from conftest import TOKEN, pid_gone, wait_until

MiB = 1 << 20


def run_threads(target, n, timeout=60.0):
    """Run ``target(i)`` on ``n`` threads; re-raise the first failure; never hang."""
    errors = []

    def wrap(i):
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            pytest.fail(f"a thread was still running after {timeout} s")
    if errors:
        raise errors[0]


def sampled_sum(buf, stride=4099) -> int:
    return int(np.frombuffer(buf, np.uint8)[::stride].sum(dtype=np.uint64))


@pytest.fixture(params=["tcp", "shm"])
def echo_conn(request, rgpu_server):
    """An echo-route connection over tcp, then over shm (whose lone call runs in C where it builds)."""
    if request.param == "shm" and shm.available() is not None:
        pytest.skip(f"shm: {shm.available()}")
    c = rgpu_server.connect("echo", transport=request.param)
    yield c
    c.close()


@pytest.fixture
def tcp_conn(rgpu_server):
    """An echo-route connection over tcp: what tcp alone does (posts gathered, the I/O thread's window)."""
    c = rgpu_server.connect("echo", transport="tcp")
    yield c
    c.close()


# ---- posts and requests --------------------------------------------------------------------

def test_a_post_returns_its_sequence_number_and_a_request_a_future(echo_conn):
    seq = echo_conn.post({"op": "note", "v": 1})
    fut = echo_conn.request({"op": "sizes"}, [b"abc"])
    assert isinstance(seq, int) and isinstance(fut, Future) and fut.seq > seq
    assert fut.result().meta == {"sizes": [3], "posts": 1}


def test_a_call_returns_every_buffer_it_sent(echo_conn):
    bufs = [b"bytes", bytearray(b"ba"), np.arange(10, dtype="f8"), torch.arange(6, dtype=torch.bfloat16),
            torch.ones(3, 4, dtype=torch.complex64).t(), torch.tensor([True, False])]
    reply = echo_conn.call({"op": "echo"}, bufs)
    from test_transport_tcp import expected_bytes
    assert [bytes(b) for b in reply.buffers] == [expected_bytes(b) for b in bufs]
    reply.release()


def test_an_empty_message_and_a_zero_byte_buffer_round_trip(echo_conn):
    assert echo_conn.call({"op": "echo"}).buffers == []
    reply = echo_conn.call({"op": "echo"}, [b"", np.empty(0), torch.empty(0, dtype=torch.bfloat16)])
    assert [b.nbytes for b in reply.buffers] == [0, 0, 0]


def test_a_512_mib_message_round_trips_into_caller_memory(echo_conn):
    src = np.zeros(512 * MiB, np.uint8)
    src[::4093] = np.arange(src[::4093].size) % 251 + 1  # sparse markers: cheap to make, shifts show
    dest = np.empty_like(src)
    reply = echo_conn.call({"op": "echo"}, [src], reply_into=[memoryview(dest)], timeout=120)
    assert reply.buffers[0].obj is dest
    assert np.array_equal(src, dest)


def test_a_reply_lands_in_caller_memory_and_a_download_fills_it(echo_conn):
    dest = bytearray(1000)
    echo_conn.call({"op": "fill", "n": 1000}, reply_into=[memoryview(dest)])
    assert bytes(dest) == bytes(i % 256 for i in range(1000))


def test_reply_into_that_is_not_writable_is_refused_before_anything_is_sent(echo_conn):
    with pytest.raises(TypeError):
        echo_conn.request({"op": "echo"}, [b"abc"], reply_into=[memoryview(b"xyz")])
    assert echo_conn.call({"op": "sizes"}, [b"ok"]).meta["sizes"] == [2]  # nothing went astray


# ---- order and threads -----------------------------------------------------------------------

def test_posts_and_requests_from_one_thread_are_applied_in_order(echo_conn):
    for i in range(200):
        echo_conn.post({"op": "note", "v": i}, [b"x" * (i * 1000)])  # small, copied, and big, written at once
        if i % 50 == 0:
            assert echo_conn.call({"op": "sizes"}).meta["posts"] == i + 1
    assert echo_conn.call({"op": "notes"}).meta["notes"] == list(range(200))


def test_many_threads_posting_at_once_lose_nothing_and_keep_each_threads_order(echo_conn):
    threads, per_thread = 8, 250
    sizes = [0, 10, 4096, 300_000]  # the last one is past post_copy_bytes: written before post() returns

    def poster(t):
        for i in range(per_thread):
            echo_conn.post({"op": "note", "v": [t, i]}, [np.full(sizes[i % 4], t, np.uint8)])

    run_threads(poster, threads)
    notes = echo_conn.call({"op": "notes"}).meta["notes"]
    assert len(notes) == threads * per_thread
    for t in range(threads):
        assert [i for tt, i in notes if tt == t] == list(range(per_thread))


def test_many_threads_requesting_at_once_each_get_their_own_reply(echo_conn):
    def requester(t):
        for i in range(100):
            payload = np.full(100 + t * 1000 + i, t, np.uint8)
            if i % 3 == 0:
                echo_conn.post({"op": "note", "v": t})
            reply = echo_conn.call({"op": "echo"}, [payload])
            assert bytes(reply.buffers[0]) == payload.tobytes()
            reply.release()

    run_threads(requester, 8)


def test_a_caller_may_change_its_buffer_as_soon_as_post_returns(echo_conn):
    for size in (1000, 4 * MiB):  # copied at the call / written before the call returns
        buf = np.full(size, 7, np.uint8)
        echo_conn.post({"op": "note", "v": size}, [buf])
        buf[:] = 0
        echo_conn.post({"op": "note", "v": size}, [buf])
    reply = echo_conn.call({"op": "notes"})
    assert reply.meta["notes"] == [1000, 1000, 4 * MiB, 4 * MiB]


def test_a_caller_may_change_its_buffer_as_soon_as_request_returns(echo_conn, rgpu_server):
    conn = rgpu_server.connect("echo", post_copy_bytes=1 << 20)
    conn.post({"op": "sleep", "s": 0.2})           # the server is busy: what follows queues up
    for _ in range(50):
        conn.post({"op": "note", "v": 0}, [b"q" * 100_000])
    buf = np.full(100_000, 9, np.uint8)
    fut = conn.request({"op": "checksum", "stride": 1}, [buf])
    buf[:] = 0
    assert fut.result(timeout=30).meta["sums"] == [9 * 100_000]


# ---- errors ----------------------------------------------------------------------------------

def test_a_failed_post_raises_remote_error_at_the_next_wait_once_naming_the_op(echo_conn):
    echo_conn.post({"op": "fail", "message": "on purpose"})
    echo_conn.post({"op": "note", "v": 1})
    with pytest.raises(RemoteError, match="on purpose") as info:
        echo_conn.call({"op": "sizes"})
    assert info.value.op == "echo.fail" and info.value.remote_type == "OpFailed"
    assert echo_conn.call({"op": "notes"}).meta["notes"] == [1]  # raised once; the session goes on


def test_a_failed_post_is_not_blamed_on_a_request_sent_before_it(echo_conn):
    first = echo_conn.request({"op": "sizes"}, [b"a"])
    echo_conn.post({"op": "fail"})
    second = echo_conn.request({"op": "sizes"}, [b"b"])
    with pytest.raises(RemoteError):
        second.result()
    assert first.result().meta["sizes"] == [1]


def test_a_failed_request_raises_remote_error_and_the_session_goes_on(echo_conn):
    with pytest.raises(RemoteError, match="unknown echo op") as info:
        echo_conn.call({"op": "no-such-op"})
    assert info.value.op == "echo.no-such-op"
    assert echo_conn.call({"op": "sizes"}, [b"x"]).meta["sizes"] == [1]


def test_rgpu_timeout_bounds_a_wait_and_the_connection_survives_it(rgpu_server):
    s = config.settings(environ={"RGPU_TIMEOUT": "0.3"}, server=rgpu_server.address, token=TOKEN)
    conn = connect("echo", settings=s)
    try:
        with pytest.raises(Timeout, match="within 0.3"):
            conn.call({"op": "sleep", "s": 1.0})
        assert conn.call({"op": "sizes"}, [b"late"], timeout=30).meta["sizes"] == [4]
    finally:
        conn.close()


def test_an_explicit_timeout_bounds_a_wait_for_another_threads_read(echo_conn):
    slow = echo_conn.request({"op": "sleep", "s": 1.0})
    later = echo_conn.request({"op": "sizes"})
    done = threading.Event()
    threading.Thread(target=lambda: (slow.result(), done.set()), daemon=True).start()
    with pytest.raises(Timeout):
        later.result(timeout=0.1)
    assert later.result(timeout=30).meta["sizes"] == []
    wait_until(done.is_set, 30, "the first reader")


def test_the_server_dying_is_connection_lost_for_every_waiter(rgpu_server):
    conn = rgpu_server.connect("echo")
    pid = conn.welcome["info"]["pid"]
    conn.post({"op": "sleep", "s": 0.3})
    conn.post({"op": "crash"})
    futures = [conn.request({"op": "sizes"}) for _ in range(4)]
    run_threads(lambda i: pytest.raises(ConnectionLost, futures[i].result), 4)
    with pytest.raises(ConnectionLost):
        conn.call({"op": "sizes"})
    with pytest.raises(ConnectionLost):
        conn.post({"op": "note", "v": 1})
    wait_until(lambda: pid_gone(pid), 10, "the crashed worker to be gone")


# ---- backpressure, flush, close, stats -------------------------------------------------------

def test_post_blocks_while_the_queue_is_full_and_loses_nothing(rgpu_server):
    limit = 1 * MiB
    conn = rgpu_server.connect("echo", queue_max_bytes=limit, post_copy_bytes=64 << 10)
    conn.post({"op": "sleep", "s": 1.0})   # the worker stops reading: the socket buffers fill, then our queue
    total, posted, high = 1000, [0], [0]   # 1000 x 64 KiB = 62.5 MiB, far more than socket buffers hold

    def poster(_):
        for i in range(total):
            conn.post({"op": "note", "v": i}, [b"p" * (64 << 10)])
            posted[0] += 1
            high[0] = max(high[0], conn._queued_bytes)

    t = threading.Thread(target=poster, args=(0,), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert high[0] <= limit + (64 << 10)   # never more than the limit plus the frame that crossed it
    assert conn.call({"op": "notes"}, timeout=60).meta["notes"] == list(range(total))


def test_flush_returns_once_every_queued_post_is_written(echo_conn):
    for i in range(500):
        echo_conn.post({"op": "note", "v": i}, [b"f" * 1000])
    echo_conn.flush()
    assert not echo_conn._queue
    assert len(echo_conn.call({"op": "notes"}).meta["notes"]) == 500


def test_close_ends_the_session_and_later_calls_raise_connection_lost(rgpu_server):
    conn = rgpu_server.connect("echo")
    pid = conn.welcome["info"]["pid"]
    conn.post({"op": "note", "v": 1})
    conn.close()
    conn.close()
    wait_until(lambda: pid_gone(pid), 10, "the session's worker to exit")
    with pytest.raises(ConnectionLost):
        conn.call({"op": "sizes"})
    with pytest.raises(ConnectionLost):
        conn.post({"op": "sizes"})


def test_stats_count_messages_round_trips_and_bytes(rgpu_server):
    conn = rgpu_server.connect("echo")
    conn.post({"op": "note"}, [b"12345"])
    conn.call({"op": "echo"}, [b"abc"]).release()
    assert conn.stats == {"messages": 2, "round_trips": 1, "bytes_out": 8, "bytes_in": 3}


# ---- no deadlock, no hang ----------------------------------------------------------------------

def test_a_large_reply_never_deadlocks_against_large_posts_sent_before_reading_it(echo_conn):
    big = np.ones(32 * MiB, np.uint8)

    def scenario(_):
        fut = echo_conn.request({"op": "echo"}, [big])          # the server writes 32 MiB back...
        for _ in range(3):
            echo_conn.post({"op": "note", "v": 0}, [big])      # ...while we write 96 MiB more
        for _ in range(200):
            echo_conn.post({"op": "note", "v": 1}, [b"s" * 60_000])  # and the I/O thread more still
        assert fut.result().buffers[0].nbytes == 32 * MiB
        fut.result().release()
        assert len(echo_conn.call({"op": "notes"}).meta["notes"]) == 203

    run_threads(scenario, 1, timeout=60)


def test_a_server_dying_mid_frame_is_connection_lost_promptly():
    """A fake server: handshake, then half a reply, then gone."""
    listener = tcp.listen("127.0.0.1", 0)
    port = listener.getsockname()[1]

    def fake_server():
        sock, _ = listener.accept()
        t = TcpTransport(sock)
        hello = handshake.server_handshake(t, TOKEN.encode(), Limits(), {"echo"})
        handshake.welcome(t, hello.session, ["tcp"], {})
        req = t.recv_frame(Limits(), __import__("rgpu.transport.wire", fromlist=["x"]).BufferPool())
        reply = encode_frame(MsgKind.REPLY, req.seq, {"ok": 1}, [b"z" * 100_000])
        sock.sendall(reply[:60_000])
        t.close()

    server = threading.Thread(target=fake_server, daemon=True)
    server.start()
    conn = connect("echo", settings=config.settings(environ={}, server=f"127.0.0.1:{port}", token=TOKEN))
    run_threads(lambda _: pytest.raises(ConnectionLost, conn.call, {"op": "echo"}), 1, timeout=10)
    server.join(10)
    listener.close()


def test_metadata_that_cannot_be_encoded_is_refused_and_the_connection_goes_on(echo_conn):
    from rgpu.errors import ProtocolError
    for send in (echo_conn.post, echo_conn.request):
        with pytest.raises(ProtocolError, match="metadata"):
            send({"op": object()})
    run_threads(lambda _: echo_conn.call({"op": "sizes"}), 1, timeout=10)


# ---- tcp: small posts gathered, written by the caller ------------------------------------------

def _count_sends(conn) -> list:
    sends, plain = [], conn.transport.send

    def counted(parts):
        sends.append(len(parts))
        plain(parts)
    conn.transport.send = counted
    return sends


def test_small_posts_over_tcp_are_gathered_into_few_writes_and_a_request_takes_them_along(tcp_conn):
    assert tcp_conn.transport_name == "tcp" and tcp_conn._batch_s
    sends = _count_sends(tcp_conn)
    for i in range(200):
        tcp_conn.post({"op": "note", "v": i})
    reply = tcp_conn.call({"op": "sizes"}, [b"x"])
    assert reply.meta == {"sizes": [1], "posts": 200}   # every post applied before the request
    assert len(sends) < 50                                # 200 posts and a request: a few writes, not 201
    assert tcp_conn.call({"op": "notes"}).meta["notes"] == list(range(200))   # in order


def test_gathered_posts_reach_the_server_by_themselves_when_the_caller_goes_quiet(echo_conn):
    for i in range(5):
        echo_conn.post({"op": "note", "v": i})
    wait_until(lambda: not echo_conn._queue, timeout=5, what="the I/O thread writing what sat past the window")
    echo_conn.flush(timeout=5)
    assert echo_conn.call({"op": "sizes"}, []).meta["posts"] == 5


def _hand_clock(monkeypatch) -> list:
    """The connection's clock (``perf_counter``), moved by hand: ``clock[0] += seconds``. Both modules that
    note when a write ended read it (a lone call, written by ``exchange``'s ``LoneCaller``, notes it too)."""
    import time
    import types

    from rgpu.transport import connection, exchange

    clock = [time.perf_counter()]
    hand = types.SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic)
    monkeypatch.setattr(connection, "time", hand)
    monkeypatch.setattr(exchange, "time", hand)
    return clock


def _settled(conn) -> None:
    """Wait until the I/O thread (if any) is idle with nothing queued: it notes when its last write ended
    only after the write, so a reply can arrive first and a hand clock moved meanwhile would be read there."""
    wait_until(lambda: conn._io_thread is None or (conn._io_idle and not conn._queue), timeout=5,
               what="the connection's I/O thread going idle")


def _writers(conn) -> list:
    """The name of the thread that made each of ``conn``'s writes from now on (its caller's, or rgpu-io)."""
    sends, plain = [], conn.transport.send

    def send(parts):
        sends.append(threading.current_thread().name)
        plain(parts)
    conn.transport.send = send
    return sends


def _past_the_fast_start(conn) -> None:
    """Posts enough for the connection's batches to be whole again (the clock frozen: never quiet after)."""
    from rgpu.transport import connection

    for _ in range(2 * connection.POST_FLUSH_COUNT):
        conn.post({"op": "note", "v": -1})
    conn.flush(timeout=5)
    _settled(conn)


def test_the_io_thread_leaves_frames_younger_than_the_gathering_window_to_their_caller(tcp_conn, monkeypatch):
    import time

    clock = _hand_clock(monkeypatch)  # frames age only when told
    _past_the_fast_start(tcp_conn)
    sends = _writers(tcp_conn)
    for i in range(5):
        tcp_conn.post({"op": "note", "v": i})
    time.sleep(0.05)                  # the I/O thread looks at them again and again meanwhile
    assert sends == [] and len(tcp_conn._queue) == 5    # young: their caller's to write
    clock[0] += 1.0                   # now they sat long: the I/O thread writes them
    wait_until(lambda: not tcp_conn._queue, timeout=5, what="the I/O thread writing what sat past the window")
    assert sends == ["rgpu-io"]
    assert tcp_conn.call({"op": "notes"}).meta["notes"][-5:] == [0, 1, 2, 3, 4]


def test_a_post_on_a_quiet_connection_goes_at_once_and_the_next_batches_double_up_to_the_flush_count(
        tcp_conn, monkeypatch):
    from rgpu.transport import connection

    clock = _hand_clock(monkeypatch)
    sends = _count_sends(tcp_conn)
    assert tcp_conn.call({"op": "sizes"}, []).meta["posts"] == 0   # a round trip, as a step's .item()
    _settled(tcp_conn)
    written = len(sends)
    clock[0] += 2 * tcp_conn._batch_s   # quiet since: the server is idle
    n = 1 + 2 + 4 + 8 + 16 + connection.POST_FLUSH_COUNT + 5
    for i in range(n):                   # no time passes: only the counts make batches due
        tcp_conn.post({"op": "note", "v": i})
    # a fast start: the first at once, then 2, 4, 8, 16, then whole batches; the last 5 gather
    assert sends[written:] == [1, 2, 4, 8, 16, connection.POST_FLUSH_COUNT]   # frames (parts) per write
    assert len(tcp_conn._queue) == 5
    clock[0] += 2 * tcp_conn._batch_s
    tcp_conn.post({"op": "note", "v": n})   # the window has passed: the caller writes all six
    assert sends[-1] == 6 and not tcp_conn._queue
    assert tcp_conn.call({"op": "notes"}).meta["notes"] == list(range(n + 1))


def test_gathered_posts_that_reach_the_flush_bytes_are_written_at_once(tcp_conn, monkeypatch):
    """A batch upload (128 KiB at a step's start) does not wait out the window: its copy dwarfs a syscall."""
    from rgpu.transport import connection

    _hand_clock(monkeypatch)             # no time passes: only the bytes can make the batch due
    _past_the_fast_start(tcp_conn)
    sends = _count_sends(tcp_conn)
    tcp_conn.post({"op": "note", "v": 0})
    tcp_conn.post({"op": "note", "v": 1})
    written, queued = len(sends), len(tcp_conn._queue)
    assert queued == 2                  # gathering
    tcp_conn.post({"op": "note", "v": 2}, [bytes(connection.POST_FLUSH_BYTES - 100)])
    assert len(tcp_conn._queue) == queued + 1 and len(sends) == written   # not yet: below the bytes
    tcp_conn.post({"op": "note", "v": 3}, [bytes(200)])
    assert not tcp_conn._queue and len(sends) == written + 1     # due: the caller wrote them, in one send
    assert tcp_conn.call({"op": "notes"}).meta["notes"][-4:] == [0, 1, 2, 3]


def test_the_io_thread_looks_less_often_while_the_caller_writes_its_own_and_still_writes_what_it_leaves(
        tcp_conn, monkeypatch):
    from rgpu.transport import connection

    clock = _hand_clock(monkeypatch)  # the I/O thread's waits are real all the same
    timeouts, plain_wait, sends = [], tcp_conn._cv.wait, _writers(tcp_conn)

    def wait(timeout=None):
        if timeout is not None and threading.current_thread().name == "rgpu-io":
            timeouts.append(timeout)
        return plain_wait(timeout)
    tcp_conn._cv.wait = wait
    window = tcp_conn._batch_s
    tcp_conn.post({"op": "note", "v": -1})    # the I/O thread starts, and the connection is no longer quiet
    tcp_conn.flush(timeout=5)
    for i in range(6):                         # the caller writes its own batches, round after round
        seen = len(timeouts)
        tcp_conn.post({"op": "note", "v": i})            # queued: the idle I/O thread is woken for it
        wait_until(lambda: len(timeouts) > seen, timeout=5, what="the I/O thread's timed wait")
        clock[0] += 2 * window
        tcp_conn.post({"op": "note", "v": i})            # the oldest sat past the window: the caller writes both
        assert not tcp_conn._queue
        wait_until(lambda: tcp_conn._io_idle, timeout=5, what="the I/O thread back in its idle wait")
    assert all(b > a for a, b in zip(timeouts, timeouts[1:4])), timeouts   # each look further off
    assert max(timeouts) <= window + connection.IO_SLACK_MAX_S + 1e-9
    assert "rgpu-io" not in sends
    tcp_conn.post({"op": "note", "v": 6})     # a caller that goes quiet: the I/O thread writes what it left
    tcp_conn.post({"op": "note", "v": 7})
    clock[0] += 1.0
    wait_until(lambda: not tcp_conn._queue, timeout=5, what="the I/O thread writing what the caller left")
    assert sends[-1] == "rgpu-io"
    assert tcp_conn.call({"op": "sizes"}, []).meta["posts"] == 15


def test_the_old_hand_off_to_the_io_thread_still_works_where_a_transport_gathers_nothing(rgpu_server, monkeypatch):
    monkeypatch.setattr(TcpTransport, "capabilities", Capabilities(resumable=True))
    conn = rgpu_server.connect("echo")
    assert conn._batch_s is None
    for i in range(100):
        conn.post({"op": "note", "v": i})
    assert conn.call({"op": "sizes"}, []).meta["posts"] == 100


def test_a_failure_inside_the_io_thread_ends_the_connection_with_a_reason_instead_of_hanging(rgpu_server, monkeypatch):
    conn = rgpu_server.connect("echo")
    monkeypatch.setattr(conn, "_write_queued", lambda: 1 / 0)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)   # the thread's own report: expected here
    try:   # the post may be the one that finds the thread dead (it writes its own frame): the same reason
        conn.post({"op": "note", "v": 1})
    except ConnectionLost as exc:
        assert "I/O thread failed: ZeroDivisionError" in str(exc)
    wait_until(lambda: not conn.alive, timeout=5, what="the connection marked dead")
    with pytest.raises(ConnectionLost, match="I/O thread failed: ZeroDivisionError"):
        conn.call({"op": "sizes"}, [])
