"""A connection's lone call: ``call()`` with nothing else in flight, written and read on the caller's thread.

A lone request needs no future: its round trip is a few microseconds over shm, where the future's
bookkeeping was most of it. ``LoneCaller`` is the reference and every transport's path but shm's C
one, where the whole call is one C call on state C owns (``shm_lone.c``'s ``LoneCall``, made by
``Transport.lone_call(LoneParts)``), which hands the rare cases back to ``exchange_alone`` and
``read_alone`` here. Both take the same steps: nothing pending or queued, the reader's token, the
send lock and the next seq under the queue's lock, the write, the read.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Sequence

from rgpu.errors import RgpuError

from .exchange import Reply
from .wire import Frame, MsgKind, as_bytes_view, encode_prefix, pack_meta, writable_view

_REQUEST = MsgKind.REQUEST


class LoneParts(NamedTuple):
    """What a connection hands a transport's C lone call (``Transport.lone_call(parts)``) when it makes it:
    the objects the call checks and takes (the queue's and the pending requests' sizes, the locks), and
    the connection's own Python for what is not the common case. The state the call changes is the C
    object's own (``exchange.py``), so nothing here is reached into."""
    limits: Any
    pending: dict
    queue: Any
    rcv_lock: Any           # guards the reader's token; ``rcv`` is its condition
    rcv: Any
    cv_lock: Any            # guards the queue and the sequence's order
    send_lock: Any          # held by whoever writes to the transport
    exchange_alone: Callable   # (seq, packed, buffers, reply_into[, sent]) -> Reply: the usual write and read
    read_alone: Callable       # (seq, reply_into, frame or None) -> Reply: the usual read
    lost: Callable             # (RgpuError) -> the error to raise: the connection is lost


class LoneCaller:
    """The lone call over ``writes`` (the connection's ``WriteQueue``) and ``router`` (its ``ReplyRouter``),
    on ``state`` (its exchange state); ``lost(exc)`` ends the connection after a failed write and returns
    the error to raise."""

    def __init__(self, writes, router, transport, state, lost: Callable):
        self.writes, self.router, self.transport, self._x, self._lost = writes, router, transport, state, lost

    def _call_alone(self, meta: Any, buffers: Sequence, reply_into, sent: Callable | None = None) -> Reply | None:
        """``call()`` when nothing else is in flight: write, then read until the reply, with no future.

        None when another thread reads or writes, a request is pending or frames are queued (nothing sent,
        ``sent`` not called): ``request()`` then does it. ``sent()`` is called once the request is written,
        before its answer is read. Raises as ``call()`` does (``TypeError`` for metadata msgpack cannot
        encode, first).
        """
        x, pending, queue = self._x, self.router.pending, self.writes.queue
        if pending or queue or x.dead or x.async_error is not None:
            return None
        packed = pack_meta(meta)              # raises before anything is sent
        rcv_lock, cv_lock = self.router.rcv_lock, self.writes.cv_lock    # acquire/release, not `with`: cheaper
        rcv_lock.acquire()
        reading, x.reading = x.reading, True
        rcv_lock.release()
        if reading:
            return None
        try:
            cv_lock.acquire()
            try:
                if queue or pending or x.dead or not self.writes.send_lock.acquire(blocking=False):
                    return None
                seq = x.next_seq()
            finally:
                cv_lock.release()
            x.messages += 1
            x.round_trips += 1
            return self._exchange_alone(seq, packed, buffers, reply_into, sent)
        finally:
            rcv_lock.acquire()                # the router's end_read(), inline: a lone call is a few microseconds
            x.reading = False
            if x.waiters:
                self.router.rcv.notify_all()
            rcv_lock.release()

    def _exchange_alone(self, seq: int, packed: bytes, buffers: Sequence, reply_into,
                        sent: Callable | None = None) -> Reply:
        """A lone call's write and read the usual way: this thread reads and holds the send lock (released here);
        ``sent()`` between the two."""
        writes = self.writes
        try:
            self._x.sending_seq = seq
            # loops, not comprehensions: each of those is a function call, and this is every call's path
            views, lengths, nbytes = [], [], 0
            for b in buffers:
                v = as_bytes_view(b)
                views.append(v)
                lengths.append(v.nbytes)
                nbytes += v.nbytes
            into = None
            if reply_into is not None:        # checked before anything is sent
                into = []
                for b in reply_into:
                    into.append(writable_view(b))
            # plain parts, which every transport's send takes; the buffers stay untouched until the reply.
            # Its ack: the last answer read, which a resumable session's server then need not keep
            prefix = encode_prefix(_REQUEST, seq, self.router.answered, packed, lengths)
            self.transport.send([prefix, *views])
        except RgpuError as exc:
            raise self._lost(exc) from None
        finally:
            if writes.batch_s is not None:
                writes.wrote_at = time.perf_counter()
            writes.send_lock.release()
        self._x.bytes_out += nbytes
        if sent is not None:
            sent()
        return self.router.read_reply(seq, into)

    def _read_alone(self, seq: int, reply_into, frame: Frame | None) -> Reply:
        """A lone call's answer after shm's C path wrote it (this thread reads): ``frame``, if it read one, first."""
        into = [writable_view(b) for b in reply_into] if reply_into is not None else None
        return self.router.read_reply(seq, into, frame)
