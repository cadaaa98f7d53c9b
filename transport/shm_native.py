"""ShmTransport's C path (``shm_fast.c`` through cffi, ``shm_native.c`` as a CPython extension): attaching
them, a connection's lone call in one call, the server's frame loop, a frame put in the ring.

Everything here declines what it cannot do (not plain memory, too big for the ring alone, no room, a
record it does not like) and the Python path of shm.py and shm_recv.py does it, naming any fault:
those remain the reference. ``NativeCalls`` is a part of ``ShmTransport`` (shm.py), kept in its own file.
"""
from __future__ import annotations

import time

from rgpu.errors import ConnectionLost, RgpuError

from . import shm_fast
from .buffers import as_bytes_view
from .connection_lone import LoneParts
from .connection_recv import Reply
from .shm_memory import Segment
from .shm_ring import KNOWN_KINDS, RECORD_MAX, _KINDS
from .wire import Frame, Limits, MsgKind, meta_packer, pack_meta, unpack_spec

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
        self._n_put, self._n_take = fast.native.put, fast.native.take
        self._n_serve, self._n_lone_call = fast.native.serve, fast.native.lone_call
        self._unpack, self._pack = unpack_spec(), meta_packer().pack
        self._n_ring, self._n_ring_any, self._n_frame = (
            int(ffi.cast("uintptr_t", p)) for p in (self._c_ring, self._c_ring_any, self._c_frame))
        ends = self._ends
        self._ends = fast.native.Ends(ends.tail, ends.head)   # the same ends, owned in C (shm_lone.c moves them)
        self._ends.closed, self._ends.shared_until = ends.closed, ends.shared_until
        self.lone_call, self.serve = self._lone_call, self._serve

    def _lone_call(self, parts: LoneParts):
        """``lone_call``: a connection's exchange state and whole lone call over this transport, in C
        (``shm_lone.c``'s ``LoneCall``): the connection's checks, locks and reply as its ``_call_alone``
        has them, the round trip in the ring on this transport's ``Ends`` (its spin as set now), and
        ``parts``' Python (``exchange_alone``, ``read_alone``, ``lost``) for what is not the common case."""
        return self._n_lone_call(self._ends, self._n_ring, self._n_frame, KNOWN_KINDS, _REQUEST, _REPLY,
                                 self.busy_s, self.spin_s, self.spin_yield, self._send_lock, self._recv_lock,
                                 self._recv_c, self._unpack, meta_packer().pack, pack_meta, Reply, Frame, _KINDS,
                                 as_bytes_view, RgpuError, *parts)

    def _serve(self, handle, applied: int, limits: Limits) -> tuple[int, int, object]:
        """A server's frame loop in C (``shm_native.c`` ``serve``) for frames wholly in the ring: each POST
        and REQUEST through ``handle(meta, buffers, wants_reply)``, a request's answer put back, until
        Python is needed. Returns (why, applied, detail): ``SERVE_IDLE`` (nothing came within the
        spin), ``SERVE_PYTHON`` (the next frame is for ``recv_frame``), ``SERVE_RAISED`` (detail: seq,
        the exception ``handle`` raised), ``SERVE_REPLY`` (detail: seq, the answer, for ``send``)."""
        with self._send_lock, self._recv_lock:
            ends = self._ends
            if ends.closed:
                raise ConnectionLost("connection closed")
            frame = self._c_frame
            frame.tail, frame.head = ends.tail, ends.head
            try:
                got = self._n_serve(self._n_ring, self._n_frame, ends.tail, ends.head, handle, self._unpack,
                                    self._pack, limits.max_meta_bytes, limits.max_buffers, limits.max_frame_bytes,
                                    _POST, _REQUEST, _REPLY, self._busy_s(time.perf_counter()), self.spin_s,
                                    self.spin_yield, applied)
                self._spun = got[0] == SERVE_IDLE    # recv_frame then sleeps without spinning again
                return got
            finally:
                ends.tail, ends.head = frame.tail, frame.head

    def _put_c(self, out) -> bool:
        """``out`` written and published by the C path, if it is a frame for the ring alone and the ring has room."""
        # False: too big for the ring alone, no room now, or not plain memory: the Python path (send checked closed)
        return bool(self._ends.put(self._n_ring, out.kind, out.flags, out.seq, out.ack, out.meta, out.views))
