"""The shm transport: read in place, memory given back, big and malformed frames, dead peers, no leaks."""
from __future__ import annotations

import gc
import os
import signal
import threading

import numpy as np
import pytest

from rgpu.errors import ConnectionLost, ProtocolError
from rgpu.transport import shm, shm_write
from rgpu.transport.shm_memory import Segment
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view
from transport_pairs import shm_pair

pytestmark = pytest.mark.skipif(shm.available() is not None, reason=str(shm.available()))

MiB = 1 << 20
LIMITS = Limits()


@pytest.fixture(params=[True, False], ids=["c", "py"])
def ends(request):
    """A connected pair on shm's C path (where it builds) or on the Python path."""
    client, server = shm_pair(request.param, request.param)
    yield client, server
    client.close()
    server.close()


def send(t, meta=None, bufs=(), kind=MsgKind.POST, seq=1):
    t.send(t.frame_parts(kind, seq, 0, meta, [as_bytes_view(b) for b in bufs]))


def recv(t, limits=LIMITS):
    return t.recv_frame(limits, BufferPool())


def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def ours() -> tuple[int, int]:
    """(open descriptors, memfd mappings of rgpu) of this process."""
    maps = open("/proc/self/maps").read()
    return len(os.listdir("/proc/self/fd")), sum("memfd:rgpu-shm" in line for line in maps.splitlines())


def test_big_buffers_are_read_in_place_in_the_senders_segment(ends):
    client, server = ends
    send(client, None, [pattern(4 * MiB), b"small"])
    f = recv(server)
    big = np.frombuffer(f.buffers[0], np.uint8)
    segs = list(server.peer.mapped.values())
    assert any(np.shares_memory(big, s.array) for s in segs)           # a view into the segment, no copy
    assert not any(np.shares_memory(np.frombuffer(f.buffers[1], np.uint8), s.array) for s in segs)
    assert np.array_equal(big, pattern(4 * MiB))
    f.release()


def test_a_held_frame_keeps_its_heap_memory_until_released(ends):
    client, server = ends
    send(client, None, [pattern(2 * MiB)])
    f = recv(server)
    client.writer.heap.reap()
    assert client.writer.heap.in_flight == 1
    f.release()
    client.writer.heap.reap()
    assert client.writer.heap.in_flight == 0


def test_dropping_every_view_gives_the_memory_back_without_release(ends):
    client, server = ends
    send(client, None, [pattern(2 * MiB), pattern(3 * MiB)])
    views = recv(server).buffers                                     # the frame itself is dropped
    derived = np.frombuffer(views[1], np.uint8)[10:20]               # a view of a view keeps it alive too
    del views
    gc.collect()
    client.writer.heap.reap()
    assert client.writer.heap.in_flight == 1
    del derived
    gc.collect()
    client.writer.heap.reap()
    assert client.writer.heap.in_flight == 0


def test_memory_freed_by_the_receiver_is_used_again_rather_than_grown(ends):
    client, server = ends
    for i in range(20):
        send(client, None, [pattern(8 * MiB, i)])
        recv(server).release()
    assert client.writer.heap.total == client.writer.heap.first_bytes


def test_the_heap_grows_while_the_receiver_holds_frames_and_trims_once_they_go(ends):
    client, server = ends
    client.writer.heap.keep_bytes = 0
    held = []
    for i in range(4):
        send(client, None, [pattern(40 * MiB, i)])
        held.append(recv(server))
    assert client.writer.heap.total >= 160 * MiB and len(client.writer.heap.segments) > 1
    for i, f in enumerate(held):
        assert np.array_equal(np.frombuffer(f.buffers[0], np.uint8), pattern(40 * MiB, i))
        f.release()
    send(client, None, [b"x" * 100])                                 # the sender reaps (and trims) on its next send
    client.writer.heap.reap()
    assert len(client.writer.heap.segments) == 1
    recv(server).release()
    server.peer.service()
    assert set(server.peer.mapped) == set(client.writer.heap.segments)         # the receiver unmapped what was dropped


def test_frames_bigger_than_the_ring_go_through_the_heap(ends):
    client, server = ends
    meta = {"blob": "m" * (600 << 10)}                                # metadata alone beyond a record
    smalls = [pattern(10 << 10, i) for i in range(100)]              # 1 MB of buffers each small enough to inline
    send(client, meta, smalls)
    f = recv(server)
    assert f.meta == meta
    assert all(bytes(b) == s.tobytes() for b, s in zip(f.buffers, smalls))
    f.release()


def test_a_full_ring_makes_the_sender_wait_and_nothing_is_lost(ends):
    client, server = ends
    n = 3000                                                          # 3000 x 3 KB: several rings' worth
    th = threading.Thread(target=lambda: [send(client, {"i": i}, [pattern(3000, i % 5)]) for i in range(n)])
    th.start()
    for i in range(n):
        f = recv(server)
        assert f.meta == {"i": i} and bytes(f.buffers[0]) == pattern(3000, i % 5).tobytes()
    th.join(30)
    assert not th.is_alive()


@pytest.mark.parametrize("left", [8, 16, 24, 32, 72])
def test_the_ring_wraps_whatever_room_is_left_at_its_end(ends, left):
    client, server = ends
    prefix = len(client.frame_parts(MsgKind.POST, 1, 0, None, [memoryview(b"")])[0].prefix)

    def record(rec_len):                    # one inline frame whose record is exactly rec_len bytes
        n = rec_len - shm.REC.size - prefix
        send(client, None, [pattern(n, rec_len)])
        assert bytes(recv(server).buffers[0]) == pattern(n, rec_len).tobytes()
    while shm.RING_BYTES - client._tail % shm.RING_BYTES > 16 << 10:
        record(8 << 10)
    record(shm.RING_BYTES - client._tail % shm.RING_BYTES - left)
    assert shm.RING_BYTES - client._tail % shm.RING_BYTES == left
    for _ in range(3):
        record(4096)                        # the first of these wraps


def test_frames_still_flow_when_both_sides_sleep_instead_of_spinning(ends):
    client, server = ends
    client.spin_s = server.spin_s = 0
    for i in range(50):
        threading.Timer(0.001, lambda i=i: send(client, {"i": i})).start()
        assert recv(server).meta == {"i": i}


# ---- a peer that breaks the format ------------------------------------------------------

def write_record(t: shm.ShmTransport, fields: tuple, body: bytes = b"") -> None:
    """Put a hand-made record at the tail of ``t``'s outgoing ring and publish it."""
    pos = t.writer.reserve(max(shm.REC.size + len(body), shm.REC.size))
    shm.REC.pack_into(t.writer.ring, pos, *fields)
    t.writer.ring[pos + shm.REC.size:pos + shm.REC.size + len(body)] = body
    t._tail += fields[0]
    t.writer.publish()


@pytest.mark.parametrize("fields, body, match", [
    ((20, shm.KIND_FRAME, shm.NO_SLOT, 0, 0, 0), b"", "record length"),
    ((64, 99, shm.NO_SLOT, 0, 0, 0), b"", "record kind"),
    ((64, shm.KIND_FRAME, shm.NO_SLOT, 0, 30, 0), b"", "shorter than a header|shorter than its contents"),
    ((64, shm.KIND_FRAME, shm.NO_SLOT, 0, 40, 0), b"XXXX" + bytes(36), "magic"),
    ((48, shm.KIND_FRAME, 0, 1, 0, 0), shm.DESC.pack(0, 77, 0), "never announced"),
    ((48, shm.KIND_FRAME, 99999, 1, 0, 0), shm.DESC.pack(0, 1, 0), "slot"),
])
def test_a_malformed_record_is_a_protocol_error_not_a_crash(ends, fields, body, match):
    client, server = ends
    write_record(client, fields, body)
    with pytest.raises(ProtocolError, match=match):
        recv(server)


def test_a_buffer_placed_past_the_end_of_its_segment_is_a_protocol_error(ends):
    client, server = ends
    send(client, None, [pattern(1 * MiB)])                           # makes and announces segment 1
    recv(server).release()
    prefix = client.frame_parts(MsgKind.POST, 1, 0, None, [memoryview(bytes(1 * MiB))])[0].prefix
    seg = client.writer.heap.segments[1]
    desc = shm.DESC.pack(0, 1, seg.size - 4096)                       # 1 MiB from 4 KiB before the end
    rec_len = (shm.REC.size + len(desc) + len(prefix) + 7) & ~7
    write_record(client, (rec_len, shm.KIND_FRAME, 0, 1, len(prefix), 0), desc + prefix)
    with pytest.raises(ProtocolError, match="past the end"):
        recv(server)


def test_a_segment_that_could_shrink_is_refused():
    fd = os.memfd_create("rgpu-test-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 * MiB)
    with pytest.raises(ProtocolError, match="sealed"):
        Segment.attach(1, fd, 1 * MiB, 16 * MiB)
    with pytest.raises(OSError):
        os.fstat(fd)                                                  # attach closed it


# ---- ends that go away ------------------------------------------------------------------

def test_closing_both_ends_leaves_no_descriptor_and_no_mapping():
    gc.collect()
    before = ours()
    for _ in range(3):
        client, server = shm_pair()
        for n in (100, 2 * MiB, 70 * MiB):                           # ring, heap, a second heap segment
            send(client, None, [pattern(n)])
            f = recv(server)
            send(server, None, f.buffers)
            f.release()
            recv(client).release()
        del f
        client.close()
        server.close()
    gc.collect()
    assert ours() == before


def test_a_view_kept_after_close_keeps_its_mapping_until_it_goes():
    gc.collect()
    before = ours()
    client, server = shm_pair()
    send(client, None, [pattern(2 * MiB)])
    kept = np.frombuffer(recv(server).buffers[0], np.uint8)
    client.close()
    server.close()
    assert np.array_equal(kept, pattern(2 * MiB))                     # still readable: nothing unmapped under it
    del kept
    gc.collect()
    assert ours() == before


def test_a_killed_server_is_noticed_at_once_and_its_mappings_go(start_server):
    gc.collect()
    before = ours()[1]                     # other tests' shm connections may still be open in this process
    server = start_server()
    conn = server.connect("echo", transport="shm")
    assert conn.transport_name == "shm"
    pid = conn.welcome["info"]["pid"]
    assert conn.call({"op": "echo"}, [pattern(4 * MiB)]).buffers[0].nbytes == 4 * MiB
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ConnectionLost):
        conn.call({"op": "sizes"}, [b"after"], timeout=60)            # Timeout here would mean not noticed
    conn.close()
    gc.collect()
    assert ours()[1] <= before


# ---- the copy into segments -------------------------------------------------------------

def test_the_parallel_copy_gives_the_same_bytes_as_memcpy():
    from rgpu.transport import fastcopy

    src = pattern(9 * MiB + 13)
    dst = np.zeros_like(src)
    try:
        fastcopy.parallel_copy(memoryview(dst), memoryview(src), threads=3)
    except RuntimeError:
        pytest.skip("numba is not installed")
    assert np.array_equal(dst, src)
    small, out = pattern(100), np.zeros(100, np.uint8)
    fastcopy.copy(memoryview(out), memoryview(small).toreadonly())
    assert np.array_equal(out, small)


def test_shm_copies_in_parallel_only_where_there_are_cores_for_it():
    from rgpu.transport import fastcopy

    expected = "memcpy" if fastcopy.cores() < fastcopy.MIN_CORES else ("numba-prange", "memcpy")
    got = fastcopy.backend()
    assert got == expected if isinstance(expected, str) else got.startswith(expected)


def test_a_frame_with_more_big_buffers_than_a_record_can_name_still_arrives(ends, monkeypatch):
    client, server = ends
    monkeypatch.setattr(shm_write, "MAX_PLACED", 8)          # the real bound is about 16 000 buffers
    bufs = [pattern((17 << 10) + i * 100, i) for i in range(20)]
    send(client, {"n": 20}, bufs)
    f = recv(server)
    assert [bytes(b) for b in f.buffers] == [b.tobytes() for b in bufs]
    f.release()
