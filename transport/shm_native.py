"""shm's C path on one end (``shm_fast.c`` through cffi, ``shm_native.c`` as a CPython extension): the
attachment (``CRing``: the C structs, functions and ``Ends``) and the calls made of it (``NativeCalls``:
a connection's lone call in one call, the server's frame loop).

Everything here declines what it cannot do (not plain memory, too big for the ring alone, no room, a
record it does not like) and the Python path (shm_write.py, shm_recv.py) does it, naming any fault:
those remain the reference.
"""
from __future__ import annotations

import time

from rgpu.errors import ConnectionLost, RgpuError

from . import shm_fast
from .exchange import LoneParts, Reply
from .shm_ring import KNOWN_KINDS, RECORD_MAX, _KINDS
from .wire import Frame, Limits, MsgKind, as_bytes_view, meta_packer, pack_meta, unpack_spec

_POST, _REQUEST, _REPLY = int(MsgKind.POST), int(MsgKind.REQUEST), int(MsgKind.REPLY)
SERVE_IDLE, SERVE_PYTHON, SERVE_RAISED, SERVE_REPLY = range(4)    # why the C loop of serve() returned


class CRing:
    """The C path attached to one end, and the state it owns: the ``rgpu_ring`` structs of the control
    segment (one for frames whose big buffers go through the heap, one, ``ring_any``, taking any buffer a
    record holds: send_meta's copies), the ``rgpu_frame`` scratch, their addresses for shm_native.c,
    and the ring ``Ends`` C owns (``ends``, the shm_lone.c type). Its functions are plain attributes,
    one lookup a call.

    Given when made: the loaded module (``shm_fast.load()``), the control segment's mapping, the
    direction this end writes, the eventfds it signals (data out, space in), where the ends start.
    """

    def __init__(self, fast, control_mm, out: int, data_out: int, space_in: int, tail: int, head: int):
        ffi, lib, native = fast.ffi, fast.lib, fast.native
        self.ring = shm_fast.ring(ffi, control_mm, out, data_out, space_in)
        self.ring_any = shm_fast.ring(ffi, control_mm, out, data_out, space_in, inline_max=RECORD_MAX)
        self.frame = ffi.new("rgpu_frame *")
        self.frame_words = ffi.buffer(self.frame)
        self.wait, self.take, self.consume = lib.rgpu_shm_wait, lib.rgpu_shm_take, lib.rgpu_shm_consume
        # the calls that take and give Python objects (shm_native.c) get the structs by address
        self.take_objects, self.serve_loop, self.lone_call = native.take, native.serve, native.lone_call
        self.ring_addr, self.ring_any_addr, self.frame_addr = (
            int(ffi.cast("uintptr_t", p)) for p in (self.ring, self.ring_any, self.frame))
        self.ends = native.Ends(tail, head)


class NativeCalls:
    """The calls a transport makes whole in C: ``lone_call(parts)`` and ``serve(handle, applied, limits)``.
    Owns nothing but this end's metadata unpacker and packer; given the ``CRing``, the ``Ends``, the
    ``Waits`` (its spin as set at each call), the transport's send and receive locks, and the receiver's
    ``recv_c`` (a frame the lone call leaves to Python)."""

    def __init__(self, c: CRing, waits, send_lock, recv_lock, recv_c):
        self._c, self._ends, self._waits = c, c.ends, waits
        self._send_lock, self._recv_lock, self._recv_c = send_lock, recv_lock, recv_c
        self._n_serve, self._n_ring, self._c_frame, self._n_frame = c.serve_loop, c.ring_addr, c.frame, c.frame_addr
        self._unpack, self._pack = unpack_spec(), meta_packer().pack
        self._busy_for, self._spun = waits.busy_for, waits.spun     # what serve calls, one lookup each

    def lone_call(self, parts: LoneParts):
        """A connection's exchange state and whole lone call over this transport, in C (``shm_lone.c``'s
        ``LoneCall``): the connection's checks, locks and reply as its ``_call_alone`` has them, the round
        trip in the ring on this transport's ``Ends`` (its spin as set now), and ``parts``' Python
        (``exchange_alone``, ``read_alone``, ``lost``) for what is not the common case."""
        w = self._waits
        return self._c.lone_call(self._ends, self._n_ring, self._n_frame, KNOWN_KINDS, _REQUEST, _REPLY,
                                 w.busy_s, w.spin_s, w.spin_yield, self._send_lock, self._recv_lock,
                                 self._recv_c, self._unpack, meta_packer().pack, pack_meta, Reply, Frame, _KINDS,
                                 as_bytes_view, RgpuError, *parts)

    def serve(self, handle, applied: int, limits: Limits) -> tuple[int, int, object]:
        """A server's frame loop in C (``shm_native.c`` ``serve``) for frames wholly in the ring: each POST
        and REQUEST through ``handle(meta, buffers, wants_reply)``, a request's answer put back, until
        Python is needed. Returns (why, applied, detail): ``SERVE_IDLE`` (nothing came within the
        spin), ``SERVE_PYTHON`` (the next frame is for ``recv_frame``), ``SERVE_RAISED`` (detail: seq,
        the exception ``handle`` raised), ``SERVE_REPLY`` (detail: seq, the answer, for ``send``).
        ``ConnectionLost`` once closed."""
        with self._send_lock, self._recv_lock:
            ends, waits = self._ends, self._waits
            if ends.closed:
                raise ConnectionLost("connection closed")
            frame = self._c_frame
            frame.tail, frame.head = ends.tail, ends.head
            try:
                got = self._n_serve(self._n_ring, self._n_frame, ends.tail, ends.head, handle, self._unpack,
                                    self._pack, limits.max_meta_bytes, limits.max_buffers, limits.max_frame_bytes,
                                    _POST, _REQUEST, _REPLY, self._busy_for(time.perf_counter()), waits.spin_s,
                                    waits.spin_yield, applied)
                self._spun(got[0] == SERVE_IDLE)    # recv_frame then sleeps without spinning again
                return got
            finally:
                ends.tail, ends.head = frame.tail, frame.head
