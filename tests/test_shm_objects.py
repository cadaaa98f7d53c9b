"""shm's parts are objects given what they need, each the one owner of its state (transport/README.md).

A ``Writer`` and a ``Receiver`` built from their constructors alone, over one control segment and no
transport, carry frames (the Python path and the C path); the transport's spin settings are its
``Waits``'; closing lets go of every part's memory; and no shm module reads another object's private
fields.
"""
from __future__ import annotations

import ast
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from rgpu.transport import shm, shm_fast
from rgpu.transport.shm_memory import PeerSegments, Segment
from rgpu.transport.shm_native import CRing
from rgpu.transport.shm_recv import Receiver
from rgpu.transport.shm_ring import CONTROL_BYTES, MAX_SEGMENT, RING_BYTES, RINGS_OFF, SLOTS, SLOTS_OFF, Ends, _words
from rgpu.transport.shm_wait import Waits
from rgpu.transport.shm_write import Writer
from rgpu.transport.wire import BufferPool, Limits, MsgKind, encode_prefix, pack_meta
from transport_pairs import shm_pair

TRANSPORT = Path(__file__).resolve().parent.parent / "transport"
pytestmark = pytest.mark.skipif(shm.available() is not None, reason=str(shm.available()))


def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class OneWay:
    """Direction 0 of a fresh control segment: a Writer at one end, a Receiver at the other (in C or not)."""

    def __init__(self, receiver_in_c: bool):
        self.control = Segment.create(0, CONTROL_BYTES, "rgpu-test-control")
        self.socks = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.efds = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(4)]
        data0, space0, data1, space1 = self.efds
        mem = memoryview(self.control.mm)
        q = mem[:SLOTS_OFF].cast("Q")
        ring = mem[RINGS_OFF:RINGS_OFF + RING_BYTES]
        tail0, head0, asleep0, waiting0 = _words(0)
        tail1, head1, asleep1, waiting1 = _words(1)
        w_ends = Ends(0, 0)
        self.w_peer = PeerSegments(self.socks[0], MAX_SEGMENT)
        w_waits = Waits(q, tail1, asleep1, head0, waiting0, w_ends, data1, space0, self.socks[0], 0, self.w_peer, 1e-4)
        self.writer = Writer(q, tail0, head0, asleep0, ring, mem[SLOTS_OFF:SLOTS_OFF + SLOTS], w_ends, data0,
                             self.socks[0], w_waits.space, lambda: None)
        c = None
        if receiver_in_c:
            fast = shm_fast.load()
            if fast is None:
                pytest.skip(f"shm's C path: {shm_fast.why_not()}")
            c = CRing(fast, self.control.mm, 1, data1, space0, 0, 0)   # the server's end: it reads direction 0
        r_ends = c.ends if c is not None else Ends(0, 0)
        self.peer = PeerSegments(self.socks[1], MAX_SEGMENT)
        self.waits = Waits(q, tail0, asleep0, head1, waiting1, r_ends, data0, space1, self.socks[1], 0, self.peer,
                           1e-4, *((c.wait, c.ring) if c is not None else ()))
        self.receiver = Receiver(q, head0, waiting0, mem[RINGS_OFF:RINGS_OFF + RING_BYTES],
                                 mem[SLOTS_OFF:SLOTS_OFF + SLOTS], r_ends, space0, self.peer, self.waits.data, c)

    def send(self, seq: int, meta, bufs: list) -> None:
        views = [memoryview(b) for b in bufs]
        self.writer.write_frame(encode_prefix(int(MsgKind.REQUEST), seq, 0, pack_meta(meta),
                                              [v.nbytes for v in views]), views)
        self.writer.publish()

    def close(self) -> None:
        self.writer.close()
        self.receiver.close()
        self.peer.close()
        for s in self.socks:
            s.close()
        for fd in self.efds:
            os.close(fd)


@pytest.mark.parametrize("in_c", [False, True], ids=["python", "c"])
def test_a_writer_and_a_receiver_made_from_their_constructors_alone_carry_frames(in_c):
    way = OneWay(in_c)
    try:
        frames = [(1, {"op": "small"}, [pattern(100, 1), pattern(3, 2)]),
                  (2, None, []),
                  (3, {"op": "big"}, [pattern(1 << 20, 3), pattern(10, 4)])]     # the first through the heap
        got = []
        for seq, meta, bufs in frames:
            way.send(seq, meta, bufs)
            f = way.receiver.recv(Limits(), BufferPool(), None)
            got.append((f.kind, f.seq, f.meta, [bytes(b) for b in f.buffers]))
            if seq == 3:
                assert way.writer.heap.in_flight == 1 and set(way.peer.mapped) == set(way.writer.heap.segments)
                f.release()
                assert way.writer.heap.reap() and way.writer.heap.in_flight == 0   # the slot came back
        assert got == [(MsgKind.REQUEST, seq, meta, [b.tobytes() for b in bufs]) for seq, meta, bufs in frames]
    finally:
        way.close()


def test_a_receiver_waits_for_a_record_until_its_deadline_and_no_longer():
    way = OneWay(False)
    try:
        t0 = time.monotonic()
        assert way.waits.data(time.monotonic() + 0.02) is False
        assert 0.015 < time.monotonic() - t0 < 1.0
        way.send(1, {"n": 1}, [])
        assert way.waits.data(time.monotonic() + 0.02) is True
    finally:
        way.close()


def test_the_transports_spin_settings_are_its_waits_own():
    assert (shm.ShmTransport.busy_s, shm.ShmTransport.spin_s, shm.ShmTransport.spin_yield) == (
        Waits.busy_s, Waits.spin_s, Waits.spin_yield)
    client, server = shm_pair(False, False)
    try:
        client.spin_s, client.spin_yield = 0.003, False
        assert (client.waits.spin_s, client.waits.spin_yield) == (0.003, False)
        assert server.waits.spin_s == server.spin_s != 0.003          # each end its own
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("use_c", [True, False], ids=["c", "python"])
def test_closing_a_transport_lets_go_of_every_parts_memory(use_c):
    if use_c and shm_fast.load() is None:
        pytest.skip(f"shm's C path: {shm_fast.why_not()}")
    client, server = shm_pair(use_c, use_c)
    client.send(client.frame_parts(MsgKind.POST, 1, 0, None, [memoryview(pattern(1 << 20))]))
    f = server.recv_frame(Limits(), BufferPool())
    assert server.peer.mapped and client.writer.heap.segments
    f.release()
    for t in (client, server):
        t.close()
        assert t.writer.heap.segments == {} and t.peer.mapped == {}
        for view in (t.writer.ring, t.writer.heap.slots):
            with pytest.raises(ValueError):
                view[0]                                   # released
    assert (client.lone_call is None, client.serve is None) == (not use_c, not use_c)


def test_no_shm_module_reads_another_objects_private_fields():
    """Each part is given what it uses: ``x._name`` only on ``self`` (one owner per piece of state)."""
    found = []
    for path in sorted(TRANSPORT.glob("shm*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
