"""shm's C path (transport/shm_fast.c): the same records as the Python path, its settings through a session.

The contract and shm tests run every case on the C path, the Python path and a mix of the two
(``transport_pairs``); these are what only the C path has.
"""
from __future__ import annotations


import numpy as np
import pytest

from rgpu.errors import ProtocolError
from rgpu.transport import base, shm, shm_fast
from rgpu.transport.wire import BufferPool, Limits, MsgKind, as_bytes_view, pack_meta
from transport_pairs import shm_pair

pytestmark = pytest.mark.skipif(shm.available() is not None or shm_fast.load() is None,
                                reason=str(shm.available() or f"shm's C path: {shm_fast.why_not()}"))

LIMITS = Limits()



def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_the_module_is_built_once_and_loaded_from_the_cache():
    assert shm_fast.load() is shm_fast.load() and shm_fast.why_not() is None
    assert len(list(shm_fast.cache_dir().glob(f"*/{shm_fast.MODULE}*.so"))) >= 1
    assert shm_fast.load(enabled=False) is None


def test_c_and_python_write_the_same_bytes():
    rings = []
    for use_c in (True, False):
        client, server = shm_pair(use_c, use_c)
        assert (client._n_put is not None) == use_c
        for i in range(5):
            client.send(client.frame_parts(MsgKind.POST, i + 1, i, {"i": i}, [as_bytes_view(pattern(100 + i, i))]))
        client.send_meta(MsgKind.POST, 9, pack_meta({"op": 1}))
        rings.append(bytes(client.writer.ring[:client._tail]))
        client.close()
        server.close()
    assert rings[0] == rings[1]


@pytest.mark.parametrize("use_c", [True, False], ids=["C path", "Python path"])
def test_a_small_upload_posted_with_send_meta_is_one_ring_record_copied_at_the_call(use_c):
    """Bigger than INLINE_MAX, yet copied into the ring record itself (the bytes are copied anyway): no heap
    slot, no bytes named, read by the peer's C path; changed once send_meta returns, it arrives as sent."""
    client, server = shm_pair(use_c, use_c)
    try:
        n = 128 << 10
        assert shm.INLINE_MAX < n and shm.REC.size + n < shm.RECORD_MAX
        buf = pattern(n, 4)
        sent = buf.copy()
        client.send_meta(MsgKind.POST, 3, pack_meta(["upload"]), [memoryview(buf)])
        buf[:] = 0
        if use_c:
            assert client.writer.heap.in_flight == 0 and client._tail >= n    # in the ring, as one record
        frame = server.recv_frame(LIMITS, BufferPool())
        assert (frame.seq, frame.meta) == (3, ["upload"])
        assert np.array_equal(np.frombuffer(frame.buffers[0], np.uint8), sent)
        frame.release()
    finally:
        client.close()
        server.close()


def test_a_malformed_record_from_a_c_peer_is_still_named_by_the_python_path(shm_ends):
    client, server = shm_ends
    pos = client.writer.reserve(64)
    shm.REC.pack_into(client.writer.ring, pos, 64, shm.KIND_FRAME, shm.NO_SLOT, 0, 40, 0)
    client.writer.ring[pos + shm.REC.size:pos + shm.REC.size + 40] = b"XXXX" + bytes(36)
    client._tail += 64
    client.writer.publish()
    with pytest.raises(ProtocolError, match="magic"):
        server.recv_frame(LIMITS, BufferPool())


# ---- through a session: RGPU_NATIVE (shm_c) and RGPU_SHM_SPIN_US (the lone call's own tests: test_shm_lone.py) ----

def test_rgpu_shm_c_0_keeps_a_session_on_the_python_path(rgpu_server):
    fast = rgpu_server.connect("echo", transport="shm")
    slow = rgpu_server.connect("echo", transport="shm", shm_c=False)
    assert fast.transport._n_put is not None and slow.transport._n_put is None
    for conn in (fast, slow):
        back = [bytearray(64)]
        conn.call({"op": "echo"}, [pattern(64, 5)], reply_into=back)
        assert bytes(back[0]) == pattern(64, 5).tobytes()


def test_rgpu_shm_spin_us_sets_how_long_a_waiting_end_polls_before_it_sleeps(rgpu_server):
    long = rgpu_server.connect("echo", transport="shm", shm_spin_us=2500)
    short = rgpu_server.connect("echo", transport="shm", shm_spin_us=0)
    endless = rgpu_server.connect("echo", transport="shm", shm_spin_us=1e9)
    assert long.transport.spin_s == 2500e-6
    assert short.transport.spin_s == short.transport.busy_s  # never less than the busy poll
    assert endless.transport.spin_s == base.MAX_SPIN_S  # a dead peer is still noticed soon
    for conn in (long, short, endless):
        back = [bytearray(64)]
        conn.call({"op": "echo"}, [pattern(64, 6)], reply_into=back)
        assert bytes(back[0]) == pattern(64, 6).tobytes()


def test_unset_rgpu_shm_spin_us_spins_long_only_on_a_machine_with_cores_to_spare(rgpu_server, monkeypatch):
    for cores, spin in ((2, shm.ShmTransport.spin_s), (16, base.LONG_SPIN_S)):
        monkeypatch.setattr(shm.os, "cpu_count", lambda: cores)
        conn = rgpu_server.connect("echo", transport="shm")
        assert conn.transport.spin_s == spin
        assert conn.call({"op": "echo"}, [b"x" * 64]).buffers[0].tobytes() == b"x" * 64
