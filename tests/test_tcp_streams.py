"""tcp over several streams (RGPU_TCP_STREAMS): big frames striped both ways byte for byte, plain and TLS;
strangers' streams refused; a bad or dropped stripe a clear error, never a hang."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from conftest import wait_until
from rgpu import config
from rgpu.errors import AuthenticationError, ConnectionLost, ProtocolError, RgpuError
from rgpu.transport import handshake, shm_fast, tcp, tcp_streams_setup
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.tcp_streams import STRIPE, STRIPE_MAGIC, StripedTcp, ranges
from rgpu.transport.wire import BufferPool, Limits, MsgKind, encode_prefix

STRIPE_BYTES = tcp_streams_setup.STRIPE_BYTES
SIZES = (STRIPE_BYTES - 1, STRIPE_BYTES, STRIPE_BYTES + 1, 3 * STRIPE_BYTES + 4093, 1, 0)


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _streams_of(conn) -> int:
    t = conn.transport
    t = getattr(t, "_inner", t)          # a resumable session's tcp end
    return t.stream_count if isinstance(t, StripedTcp) else 1


def _echo_both_ways(conn) -> None:
    for seed, n in enumerate(SIZES):
        src = _random(n, seed)
        back = np.zeros(n, np.uint8)
        conn.call({"op": "echo"}, [src], reply_into=[back])        # into the caller's memory
        assert np.array_equal(back, src), n
        reply = conn.call({"op": "echo"}, [src])                     # into the pool's
        assert bytes(reply.buffers[0]) == src.tobytes(), n
        reply.release()
    parts = [_random(STRIPE_BYTES // 2 + 3, 7), _random(17, 8), _random(STRIPE_BYTES // 2 + 5, 9)]  # crosses it in all
    conn.post({"op": "note", "v": 1}, parts)
    reply = conn.call({"op": "echo"}, parts)
    assert [bytes(b) for b in reply.buffers] == [p.tobytes() for p in parts]
    reply.release()


@pytest.fixture(scope="module")
def streams_server(tmp_path_factory):
    from conftest import RunningServer

    server = RunningServer(tmp_path_factory.mktemp("streams"), env={"RGPU_TCP_STREAMS": "4"})
    yield server
    server.stop()


@pytest.mark.parametrize("streams", [1, 4])
def test_big_frames_arrive_byte_exact_both_ways_on_one_stream_and_on_four(streams_server, streams):
    conn = streams_server.connect("echo", tcp_streams=streams)
    assert _streams_of(conn) == streams
    _echo_both_ways(conn)
    conn.close()


def test_over_tls_each_stream_is_its_own_tls_socket_and_the_bytes_arrive_the_same(start_server):
    server = start_server("--tls", env={"RGPU_TCP_STREAMS": "4"})
    wait_until(lambda: "RGPU_TLS_FINGERPRINT=" in server.stdout, what="the fingerprint line")
    pin = server.stdout.split("RGPU_TLS_FINGERPRINT=")[1].split()[0]
    conn = server.connect("echo", tcp_streams=4, tls_fingerprint=pin)
    inner = getattr(conn.transport, "_inner", conn.transport)
    assert isinstance(inner, StripedTcp) and inner.tls and all(s.version() for s in inner.streams)
    if shm_fast.load() is not None:       # the big reads go in C (tls_fast.py), on every stream
        assert inner._reader.read_exactly is not None and all(r is not None for r in inner._exact)
    _echo_both_ways(conn)
    conn.close()


def test_a_server_that_wants_one_stream_keeps_the_session_on_one(start_server):
    server = start_server(env={"RGPU_TCP_STREAMS": "1"})
    conn = server.connect("echo", tcp_streams=4)
    assert _streams_of(conn) == 1
    _echo_both_ways(conn)


# ---- the attaching, in process: strangers refused ---------------------------------------------------

TOKEN = b"t" * 32


@pytest.fixture
def offer():
    listener = tcp.listen("127.0.0.1", 0)
    client_main = tcp.connect("127.0.0.1", listener.getsockname()[1], 5)
    server_main, _ = listener.accept()
    listener.close()
    settings = config.settings(environ={}, tcp_streams=4, connect_timeout=5.0)
    hello = handshake.Hello(route="echo", session="s1", versions={}, transports=[], options={"streams": 4})
    made = tcp_streams_setup.ServerOffer.make(server_main, hello, settings, TOKEN, None)
    result: dict = {}

    def attach():
        try:
            result["t"] = made.attach(TcpTransport(server_main))
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=attach, daemon=True)
    thread.start()
    yield made, TcpTransport(client_main), hello, settings, thread, result
    client_main.close()
    server_main.close()


def _dial(made, hello, settings, token=TOKEN, ticket=None, index=1, session=None):
    h = handshake.Hello(route=hello.route, session=session or hello.session, versions={}, transports=[])
    return tcp_streams_setup._dial("127.0.0.1", made.details()["port"], token, h, settings, False, index,
                                   made.ticket if ticket is None else ticket)


def test_a_stranger_without_the_token_or_the_ticket_cannot_attach_a_stream(offer):
    made, main, hello, settings, thread, result = offer
    with pytest.raises(AuthenticationError):
        _dial(made, hello, settings, token=b"w" * 32)                 # does not know the token
    with pytest.raises(AuthenticationError, match="names no session"):
        _dial(made, hello, settings, ticket=b"x" * 32)                # knows it, not this session's ticket
    with pytest.raises(AuthenticationError, match="names no session"):
        _dial(made, hello, settings, session="someone-else")
    with pytest.raises(ProtocolError):
        _dial(made, hello, settings, index=9)                         # no such stream
    good = _dial(made, hello, settings, index=1)
    main.send(main.frame_parts(MsgKind.UPGRADE, 0, 0, {"transport": "tcp", "streams": [1]}, []))
    thread.join(10)
    assert isinstance(result.get("t"), StripedTcp) and result["t"].stream_count == 2
    result["t"].close()
    good.close()


def test_a_client_naming_a_stream_that_never_attached_is_a_protocol_error(offer):
    made, main, hello, settings, thread, result = offer
    main.send(main.frame_parts(MsgKind.UPGRADE, 0, 0, {"transport": "tcp", "streams": [1, 2]}, []))
    thread.join(10)
    assert isinstance(result.get("error"), ProtocolError) and "attached" in str(result["error"])


# ---- the striped data path over socket pairs ----------------------------------------------------


def _pair(n: int, stripe: int):
    mains = socket.socketpair()
    extra = [socket.socketpair() for _ in range(n - 1)]
    a = StripedTcp(TcpTransport(mains[0]), [p[0] for p in extra], stripe)
    b = StripedTcp(TcpTransport(mains[1]), [p[1] for p in extra], stripe)
    return a, b, mains, extra


def _frame(seq: int, *bufs) -> list:
    return [encode_prefix(MsgKind.POST, seq, 0, b"", [memoryview(x).nbytes for x in bufs]), *bufs]


def _in_thread(fn, *args) -> dict:
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    out["thread"] = thread
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_striped_frames_among_small_ones_in_one_send_arrive_in_order_and_exact(n):
    stripe = 64 << 10
    a, b, *_ = _pair(n, stripe)
    bufs = [_random(k, k) for k in (stripe - 1, stripe, stripe + 1, 5 * stripe + 3, 100)]
    parts = [p for i, buf in enumerate(bufs) for p in _frame(i + 1, buf)]
    sending = _in_thread(a.send, parts)
    for i, buf in enumerate(bufs):
        frame = b.recv_frame(Limits(), BufferPool())
        assert frame.seq == i + 1 and bytes(frame.buffers[0]) == buf.tobytes()
        frame.release()
    sending["thread"].join(10)
    assert "error" not in sending
    a.close()
    b.close()


def test_once_a_striped_send_or_read_returns_no_stream_holds_a_view_of_the_callers_memory():
    a, b, *_ = _pair(4, 1 << 16)
    src, dest = bytearray(_random(1 << 20, 5).tobytes()), bytearray(1 << 20)
    sending = _in_thread(a.send, _frame(1, src))
    frame = b.recv_frame(Limits(), BufferPool(), into=lambda kind, seq, lengths: [memoryview(dest)])
    sending["thread"].join(10)
    assert "error" not in sending and dest == src
    del frame, sending
    src.append(0)             # a bytearray with a view still exported cannot be resized (BufferError)
    dest.append(0)
    a.close()
    b.close()


def test_ranges_cover_every_byte_once_on_page_boundaries():
    for total in (0, 1, 4095, 4096 * 4 + 1, 10 << 20):
        cuts = ranges(total, 4)
        assert cuts[0][0] == 0 and cuts[-1][1] == total
        assert all(x[1] == y[0] for x, y in zip(cuts, cuts[1:]))
        assert all(c[0] % 4096 == 0 for c in cuts)


def _raw_big_frame(mains, n_total: int, stripe_bytes: int):
    """What a sender puts on the main socket for one striped frame of ``n_total`` bytes over 2 streams."""
    (start, stop), second = ranges(n_total, 2)
    mains[0].sendall(encode_prefix(MsgKind.POST, 1, 0, b"", [n_total]) + bytes(stop - start))
    return second


def test_a_stripe_naming_no_pending_frame_or_a_short_one_is_a_protocol_error():
    for bad, match in (({"count": 5}, "names no frame"), ({"short": True}, "short or misplaced")):
        a, b, mains, extra = _pair(2, 1 << 16)
        start, stop = _raw_big_frame(mains, 1 << 18, 1 << 16)
        length = (stop - start) // 2 if bad.get("short") else stop - start
        extra[0][0].sendall(STRIPE.pack(STRIPE_MAGIC, bad.get("count", 0), start, length))
        got = _in_thread(b.recv_frame, Limits(), BufferPool())
        got["thread"].join(5)
        assert isinstance(got.get("error"), ProtocolError) and match in str(got["error"]), got
        a.close()
        b.close()


def test_a_stream_dropped_mid_frame_ends_the_read_with_connection_lost_within_seconds():
    a, b, mains, extra = _pair(2, 1 << 16)
    start, stop = _raw_big_frame(mains, 1 << 18, 1 << 16)
    extra[0][0].sendall(STRIPE.pack(STRIPE_MAGIC, 0, start, stop - start) + bytes(100))
    extra[0][0].close()                      # the stream goes, mid-stripe
    got = _in_thread(b.recv_frame, Limits(), BufferPool())
    got["thread"].join(5)
    assert not got["thread"].is_alive() and isinstance(got.get("error"), ConnectionLost), got
    assert "stream 1 of 2" in str(got["error"])


def test_a_send_whose_stream_the_peer_dropped_fails_with_connection_lost():
    a, b, mains, extra = _pair(2, 1 << 16)
    extra[0][1].close()                      # the peer's end of stream 1
    b.streams[0].close()
    sending = _in_thread(a.send, _frame(1, _random(8 << 20, 1)))
    sending["thread"].join(5)
    assert not sending["thread"].is_alive() and isinstance(sending.get("error"), RgpuError), sending
    a.close()


def test_a_session_on_four_streams_whose_main_connection_is_cut_mid_frame_resumes_on_one(start_server):
    from session_proxy import Cut, CuttingProxy

    server = start_server(env={"RGPU_TCP_STREAMS": "4", "RGPU_SESSION_GRACE": "30"})
    proxy = CuttingProxy((server.host, server.port), {0: Cut("up", offset=STRIPE_BYTES // 4)})   # inside range 0
    try:
        from rgpu.transport.client import connect
        conn = connect("echo", settings=server.settings(tcp_streams=4).with_(server=proxy.address))
        assert _streams_of(conn) == 4
        src = _random(4 * STRIPE_BYTES + 11, 3)
        reply = conn.call({"op": "echo"}, [src])          # cut mid-frame, resumed, replayed
        assert bytes(reply.buffers[0]) == src.tobytes()
        reply.release()
        assert conn.transport.resumes == 1 and proxy.cuts_done and _streams_of(conn) == 1
        _echo_both_ways(conn)                              # and on one stream from there
        conn.close()
    finally:
        proxy.close()


def test_every_stream_of_a_resumable_session_gives_a_silent_link_up_within_half_its_grace(start_server):
    # a stripe blocked on a dead link must fail as soon as the main socket's write does, not the kernel's minute
    server = start_server(env={"RGPU_TCP_STREAMS": "4", "RGPU_SESSION_GRACE": "16"})
    conn = server.connect("echo", tcp_streams=4)
    try:
        striped = conn.transport._inner
        assert _streams_of(conn) == 4
        for s in [striped.sock, *striped.streams]:
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 8000
        _echo_both_ways(conn)
    finally:
        conn.close()
