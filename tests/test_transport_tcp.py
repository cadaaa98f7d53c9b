"""The tcp transport: every buffer kind and dtype through a real socket, receive targets, a peer dying mid-frame."""
from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest
import torch

from rgpu.errors import ConnectError, ConnectionLost
from rgpu.transport import base, shm_fast, tcp
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import HEADER, BufferPool, Limits, MsgKind, as_bytes_view, encode_frame

LIMITS = Limits()


def connected_pair() -> tuple[TcpTransport, TcpTransport]:
    listener = tcp.listen("127.0.0.1", 0)
    a_sock = tcp.connect("127.0.0.1", listener.getsockname()[1], timeout=5)
    b_sock, _ = listener.accept()
    listener.close()
    a_sock.settimeout(None)
    return TcpTransport(a_sock), TcpTransport(b_sock)


@pytest.fixture(params=["sleeping reads", "spinning reads"])
def pair(request):
    """Two connected TcpTransports over 127.0.0.1; reads that sleep at once, or poll 2 ms first (in C)."""
    a, b = connected_pair()
    if request.param == "spinning reads":
        if shm_fast.load() is None:
            pytest.skip(f"no C path here: {shm_fast.why_not()}")
        for end in (a, b):
            end.tune_reads(2000)
            assert end.spin_s == 2000e-6
    yield a, b
    a.close()
    b.close()


def call_with_timeout(fn, timeout=10.0):
    """Run ``fn`` on a thread; returns its result or raises its exception; fails instead of hanging."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"still blocked after {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def send_and_receive(a, b, buffers, meta=None, into=None):
    views = [as_bytes_view(x) for x in buffers]
    sender = threading.Thread(target=a.send, args=(a.frame_parts(MsgKind.REQUEST, 5, 0, meta, views),))
    sender.start()  # big buffers do not fit the socket buffers: receive while sending
    frame = call_with_timeout(lambda: b.recv_frame(LIMITS, BufferPool(), into))
    sender.join()
    return frame


def expected_bytes(obj) -> bytes:
    """What the receiver must get: the logical elements in C order, in native byte layout."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().resolve_conj().resolve_neg().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    if isinstance(obj, np.ndarray):
        return np.ascontiguousarray(obj).tobytes()
    return memoryview(obj).tobytes()


ALL_TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                    torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                    torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def _tensor(dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 255, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


TENSORS = {
    **{f"contiguous {d}": (lambda d=d: _tensor(d)) for d in ALL_TORCH_DTYPES},
    **{f"transposed {d}": (lambda d=d: _tensor(d).t()) for d in ALL_TORCH_DTYPES},
    "strided slice": lambda: torch.arange(100, dtype=torch.float32)[::7],
    "expanded": lambda: torch.arange(4, dtype=torch.int32).expand(3, 4),
    "0-dim": lambda: torch.tensor(3.5, dtype=torch.bfloat16),
    "empty": lambda: torch.empty(0, 4),
    "requires grad": lambda: torch.ones(4, requires_grad=True) * 2,
    "conjugate view": lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(),
    "negative view": lambda: torch.tensor([1 + 2j, 3 - 4j]).conj().imag,
    "channels last": lambda: torch.arange(2 * 3 * 4 * 5, dtype=torch.float16).reshape(2, 3, 4, 5).to(
        memory_format=torch.channels_last),
    "a view into a bigger storage": lambda: torch.arange(64, dtype=torch.int64)[10:20],
}

ARRAYS = {
    **{f"numpy {d}": (lambda d=d: np.arange(24).astype(d).reshape(4, 6))
       for d in ["bool", "u1", "i1", "i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]},
    "numpy big-endian": lambda: np.arange(10, dtype=">f8"),
    "numpy fortran order": lambda: np.asfortranarray(np.arange(12, dtype="f4").reshape(3, 4)),
    "numpy strided": lambda: np.arange(100, dtype="i4")[::3],
    "numpy structured": lambda: np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")]),
    "numpy 0-d": lambda: np.array(7, dtype="i2"),
    "numpy empty": lambda: np.empty((0, 3), dtype="f4"),
}

PLAIN = {
    "bytes": lambda: b"hello",
    "empty bytes": lambda: b"",
    "bytearray": lambda: bytearray(b"\x00\x01\x02" * 100),
    "memoryview": lambda: memoryview(b"abcdef")[1:5],
    "memoryview of doubles": lambda: memoryview(np.arange(6, dtype="f8")),
    "2-d memoryview": lambda: memoryview(np.arange(12, dtype="i2").reshape(3, 4)),
    "non-contiguous memoryview": lambda: memoryview(np.arange(12, dtype="i4"))[::3],
    "non-contiguous 2-d memoryview": lambda: memoryview(np.arange(12, dtype="i4").reshape(3, 4)[:, ::2]),
    "array.array": lambda: __import__("array").array("d", [1.0, 2.0, 3.0]),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_every_torch_dtype_and_layout_arrives_byte_exact(pair, name):
    a, b = pair
    t = TENSORS[name]()
    frame = send_and_receive(a, b, [t])
    assert bytes(frame.buffers[0]) == expected_bytes(t)


@pytest.mark.parametrize("name", list(ARRAYS) + list(PLAIN))
def test_every_buffer_kind_arrives_byte_exact(pair, name):
    a, b = pair
    obj = {**ARRAYS, **PLAIN}[name]()
    frame = send_and_receive(a, b, [obj])
    assert bytes(frame.buffers[0]) == expected_bytes(obj)


def test_a_received_bfloat16_buffer_views_back_into_the_same_tensor(pair):
    a, b = pair
    t = torch.randn(7, 3).to(torch.bfloat16)
    frame = send_and_receive(a, b, [t])
    back = torch.frombuffer(frame.buffers[0], dtype=torch.uint8).view(torch.bfloat16).reshape(7, 3)
    assert torch.equal(back, t)


def test_a_contiguous_source_is_sent_without_a_copy():
    t = torch.arange(16, dtype=torch.float32)
    view = as_bytes_view(t)
    t[0] = 42.0
    assert np.frombuffer(view, np.float32)[0] == 42.0
    arr = np.zeros(8)
    v2 = as_bytes_view(arr)
    arr[1] = 1.0
    assert np.frombuffer(v2, "f8")[1] == 1.0


@pytest.mark.parametrize("obj", [np.array([object()]), torch.empty(3, device="meta"), "a string", 12, [1, 2]],
                         ids=["object array", "meta tensor", "str", "int", "list"])
def test_what_cannot_be_sent_is_refused_with_a_type_error(obj):
    with pytest.raises(TypeError):
        as_bytes_view(obj)


def test_more_parts_than_one_sendmsg_takes_arrive_in_order(pair):
    a, b = pair
    bufs = [bytes([i % 251]) * (i % 5) for i in range(3000)]
    frame = send_and_receive(a, b, bufs)
    assert [bytes(x) for x in frame.buffers] == bufs


def test_a_reply_lands_in_caller_memory_when_the_sizes_match(pair):
    a, b = pair
    dest = [memoryview(bytearray(5)), memoryview(bytearray(3))]
    frame = send_and_receive(a, b, [b"abcde", b"xyz"], into=lambda kind, seq, lengths: dest)
    assert frame.buffers[0] is dest[0] and bytes(dest[0]) == b"abcde" and bytes(dest[1]) == b"xyz"
    assert frame.releaser is None


def test_a_reply_of_other_sizes_goes_to_the_pool_instead(pair):
    a, b = pair
    dest = [memoryview(bytearray(4))]
    frame = send_and_receive(a, b, [b"abcde"], into=lambda kind, seq, lengths: dest)
    assert bytes(frame.buffers[0]) == b"abcde" and bytes(dest[0]) == bytes(4)
    frame.release()


def test_a_pool_buffer_is_not_handed_out_again_until_released():
    pool = BufferPool()
    v1, t1 = pool.lease(1000)
    v2, t2 = pool.lease(1000)
    assert t1 is not t2
    pool.release(t1)
    v3, t3 = pool.lease(900)
    assert t3 is t1
    assert len(v3) == 900


def test_a_pool_keeps_no_more_free_memory_than_its_limit():
    pool = BufferPool(keep_bytes=8192)
    tokens = [pool.lease(4096)[1] for _ in range(4)]
    for t in tokens:
        pool.release(t)
    assert pool._kept == 8192


@pytest.mark.parametrize("cut", ["in the header", "in the buffer lengths", "in the metadata", "in a buffer"])
@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_peer_dying_mid_frame_is_connection_lost_promptly(pair, cut, how):
    a, b = pair
    data = encode_frame(MsgKind.POST, 1, {"op": "x" * 50}, [b"y" * 100_000])
    at = {"in the header": 10, "in the buffer lengths": HEADER.size + 3, "in the metadata": HEADER.size + 12,
          "in a buffer": len(data) - 50_000}[cut]
    a.sock.sendall(data[:at])
    if how == "reset":  # a killed process with unread data: the kernel sends RST
        a.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    a.close()
    with pytest.raises(ConnectionLost):
        call_with_timeout(lambda: b.recv_frame(LIMITS, BufferPool()))


def test_sending_to_a_peer_that_went_away_is_connection_lost(pair):
    a, b = pair
    b.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    b.close()
    with pytest.raises(ConnectionLost):
        for _ in range(100):  # the first write may still be accepted by the kernel
            call_with_timeout(lambda: a.send([memoryview(b"x" * 65536)]))


def test_abort_wakes_a_thread_blocked_receiving(pair):
    a, b = pair
    result = {}

    def receive():
        try:
            b.recv_frame(LIMITS, BufferPool())
        except ConnectionLost as exc:
            result["error"] = exc

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    b.abort()
    t.join(10)
    assert not t.is_alive() and isinstance(result.get("error"), ConnectionLost)


def test_readable_says_whether_a_frame_has_started_to_arrive(pair):
    a, b = pair
    assert not b.readable(0)
    a.send([encode_frame(MsgKind.BYE, 0)])
    assert b.readable(5)


def test_connecting_where_nothing_listens_is_a_connect_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConnectError, match=str(port)):
        tcp.connect("127.0.0.1", port, timeout=5)


def test_sockets_are_tuned_for_latency_and_dead_peers(pair):
    a, _ = pair
    assert a.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert a.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)


def test_a_frame_that_comes_after_the_spin_is_still_read():
    a, b = connected_pair()
    try:
        if shm_fast.load() is None:
            pytest.skip(f"no C path here: {shm_fast.why_not()}")
        b.tune_reads(500)                        # polls 0.5 ms, then sleeps in recv
        later = threading.Timer(0.05, lambda: a.send([encode_frame(MsgKind.POST, 3, {"op": "late"})]))
        later.start()
        frame = call_with_timeout(lambda: b.recv_frame(LIMITS, BufferPool()))
        assert (frame.seq, frame.meta) == (3, {"op": "late"})
        later.join()
    finally:
        a.close()
        b.close()


def test_reads_spin_by_default_only_on_a_machine_with_cores_to_spare(monkeypatch):
    for cores, spin in ((2, 0.0), (16, base.LONG_SPIN_S)):
        monkeypatch.setattr(base.os, "cpu_count", lambda: cores)
        assert base.spin_seconds(None, 0.0) == spin
    assert base.spin_seconds(1e9, 0.0) == base.MAX_SPIN_S      # a dead peer is still noticed soon
    assert base.spin_seconds(-5, 0.0) == 0.0
    a, b = connected_pair()
    try:
        b.tune_reads(0)
        assert b.spin_s == 0.0 and b._reader.recv_into == b.sock.recv_into   # no spin: the socket's own read
        b._tls = True                            # TLS reads go through the SSL object: never spun
        b.tune_reads(2000)
        assert b.spin_s == 0.0 and b._reader.recv_into == b.sock.recv_into
    finally:
        a.close()
        b.close()


def test_rgpu_tcp_spin_us_sets_how_long_a_client_polls_before_it_sleeps(rgpu_server):
    if shm_fast.load() is None:
        pytest.skip(f"no C path here: {shm_fast.why_not()}")
    conn = rgpu_server.connect("echo", transport="tcp", tcp_spin_us=1500)
    assert conn.transport.spin_s == 1500e-6
    back = [bytearray(64)]
    for i in range(20):
        payload = bytes([i]) * 64
        conn.call({"op": "echo"}, [payload], reply_into=back)
        assert bytes(back[0]) == payload


def test_a_server_whose_reads_spin_serves_small_and_large_frames(start_server):
    if shm_fast.load() is None:
        pytest.skip(f"no C path here: {shm_fast.why_not()}")
    server = start_server(env={"RGPU_TCP_SPIN_US": "3000"})
    conn = server.connect("echo", transport="tcp")
    big = np.arange(1 << 20, dtype=np.uint8)
    for i in range(10):
        back = [bytearray(64)]
        conn.call({"op": "echo"}, [bytes([i]) * 64], reply_into=back)
        assert bytes(back[0]) == bytes([i]) * 64
        stride = 4093
        sums = conn.call({"op": "checksum", "stride": stride}, [big]).meta["sums"]
        assert sums == [int(big[::stride].sum(dtype=np.uint64))]
