"""ShmTransport's C path (``shm_fast.c`` through cffi, ``shm_native.c`` as a CPython extension): attaching
them, a lone request and its reply in one call, the server's frame loop, a frame put in the ring.

Everything here declines what it cannot do (not plain memory, too big for the ring alone, no room, a
record it does not like) and the Python path of shm.py and shm_recv.py does it, naming any fault:
those remain the reference. ``NativeCalls`` is a part of ``ShmTransport`` (shm.py), kept in its own file.
"""
from __future__ import annotations

import time

import msgpack

from rgpu.errors import ConnectionLost

from . import shm_fast
from .buffers import as_bytes_view
from .shm_memory import Segment
from .shm_ring import KNOWN_KINDS, RECORD_MAX, _KINDS
from .wire import Frame, Limits, MsgKind, unpack_spec

_POST, _REQUEST, _REPLY = int(MsgKind.POST), int(MsgKind.REQUEST), int(MsgKind.REPLY)
SERVE_IDLE, SERVE_PYTHON, SERVE_RAISED, SERVE_REPLY = range(4)    # why the C loop of serve() returned


class NativeCalls:
    """ShmTransport's C path (the attributes they use are set in its ``__init__``)."""

    def _attach_c(self, fast, control: Segment, out: int) -> None:
        """Use the C path (shm_fast.c): its functions and scratch kept as plain attributes, one lookup a call."""
        ffi, lib = fast.ffi, fast.lib
        self._c_ring = shm_fast.ring(ffi, control.mm, out, self._data_out, self._space_in)
        # the same ring for frames whose buffers are copies anyway (send_meta's): any buffer a record holds
        self._c_ring_any = shm_fast.ring(ffi, control.mm, out, self._data_out, self._space_in, inline_max=RECORD_MAX)
        self._c_frame = ffi.new("rgpu_frame *")
        self._c_frame_words = ffi.buffer(self._c_frame)
        self._c_wait, self._c_take, self._c_consume = lib.rgpu_shm_wait, lib.rgpu_shm_take, lib.rgpu_shm_consume
        # the calls that take and give Python objects (shm_native.c) get the structs by address
        self._n_put, self._n_take, self._n_call = fast.native.put, fast.native.take, fast.native.call
        self._n_serve = fast.native.serve
        self._unpack, self._pack = unpack_spec(), msgpack.Packer(use_bin_type=True).pack
        self._n_ring, self._n_ring_any, self._n_frame = (
            int(ffi.cast("uintptr_t", p)) for p in (self._c_ring, self._c_ring_any, self._c_frame))
        self.call_alone, self.serve = self._lone_call(), self._serve

    def _lone_call(self):
        """``call_alone``: a lone request written and its reply read in one C call (``shm_native.c``).

        Its arguments: seq, packed meta, buffers and ``into`` (a list of one buffer, or None) as the
        caller has them, the connection's limits; it returns (bytes sent, the reply's frame). Whatever
        the C call cannot take straight (not contiguous, not writable, a tensor, too many, too big, no
        room) makes it (-1, None), nothing written, for the usual path; (n, None) means the reply is not
        here yet or is one for ``recv_frame``. The caller holds the connection's send lock and is its
        only reader. A closure: a lone round trip is a few microseconds, and attribute lookups add up.
        """
        n_call, ring, frame, unpack = self._n_call, self._n_ring, self._n_frame, self._unpack
        send_lock, recv_lock, clock, busy_s = self._send_lock, self._recv_lock, time.perf_counter, self._busy_s

        def call_alone(seq: int, meta: bytes, buffers, into, limits) -> tuple[int, object]:
            if into is not None and len(into) != 1:
                return -1, None
            send_lock.acquire()           # not `with`: the pair costs a third more, a lone call is microseconds
            recv_lock.acquire()
            try:
                if self._closed:
                    raise ConnectionLost("connection closed")
                done = n_call(ring, frame, self._tail, self._head, _REQUEST, seq, meta, buffers,
                              None if into is None else into[0],
                              busy_s(clock()), self.spin_s, self.spin_yield,
                              limits.max_meta_bytes, limits.max_buffers, limits.max_frame_bytes, KNOWN_KINDS, unpack)
                if done is None:
                    return -1, None
                got, sent, self._tail, self._head, reply = done
                if got < 0:
                    return -1, None
                if reply is not None:
                    kind, rseq, ack, meta, copied_into = reply
                    return sent, Frame(_KINDS[kind], rseq, ack, meta, [as_bytes_view(into[0])] if copied_into else [])
                return sent, self._recv_c(limits, None) if got == 1 else None
            finally:
                recv_lock.release()
                send_lock.release()
        return call_alone

    def _serve(self, handle, applied: int, limits: Limits) -> tuple[int, int, object]:
        """A server's frame loop in C (``shm_native.c`` ``serve``) for frames wholly in the ring: each POST
        and REQUEST through ``handle(meta, buffers, wants_reply)``, a request's answer put back, until
        Python is needed. Returns (why, applied, detail): ``SERVE_IDLE`` (nothing came within the
        spin), ``SERVE_PYTHON`` (the next frame is for ``recv_frame``), ``SERVE_RAISED`` (detail: seq,
        the exception ``handle`` raised), ``SERVE_REPLY`` (detail: seq, the answer, for ``send``)."""
        with self._send_lock, self._recv_lock:
            if self._closed:
                raise ConnectionLost("connection closed")
            frame = self._c_frame
            frame.tail, frame.head = self._tail, self._head
            try:
                got = self._n_serve(self._n_ring, self._n_frame, self._tail, self._head, handle, self._unpack,
                                    self._pack, limits.max_meta_bytes, limits.max_buffers, limits.max_frame_bytes,
                                    _POST, _REQUEST, _REPLY, self._busy_s(time.perf_counter()), self.spin_s,
                                    self.spin_yield, applied)
                self._spun = got[0] == SERVE_IDLE    # recv_frame then sleeps without spinning again
                return got
            finally:
                self._tail, self._head = frame.tail, frame.head

    def _put_c(self, out) -> bool:
        """``out`` written and published by the C path, if it is a frame for the ring alone and the ring has room."""
        tail = self._n_put(self._n_ring, self._tail, out.kind, out.flags, out.seq, out.ack, out.meta, out.views)
        if tail is None or tail < 0:
            return False     # too big for the ring alone, no room now, or not plain memory: the Python path
        self._tail = tail
        return True
