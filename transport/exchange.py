"""What a connection's exchange with its peer shares: one state, and the router of its replies.

``Exchange`` holds the sequence, the reader's token (``reading``; ``waiters``, the threads waiting for
the reader to hand them their answer), the seq of the write in progress, why the connection died, a
failed post's kept error and the stats counters. The connection's write queue (``connection.py``), and
the ``ReplyRouter`` and ``LoneCaller`` here all work on it. Over shm with its C path the same face is a
C object (``shm_lone.c``'s ``LoneCall``), which is also the lone call itself, so that C and Python share
one copy of this state and neither reads the other's private fields; ``Exchange`` and ``LoneCaller``
are the same for every other transport (and the reference).

``ReplyRouter`` hands replies to their futures by whichever thread reads; it owns the pending futures
by seq and the reader's lock and condition, and is given the exchange state with everything else.

- Whichever waiting thread takes the reader's token reads frames and hands each reply to its future;
  the others wait on a condition until theirs is done.
- A post that fails on the server comes back as an ERROR frame with no request waiting for it; the
  first is kept and raised once, at the next wait for a request sent after that post.
- A write never waits on a full socket while replies are due: the writer reads them meanwhile
  (``drain_while_blocked``, the transport's ``on_block``), because the server, blocked writing a reply
  nobody reads, would never read our write.

``LoneCaller`` is the lone call: ``call()`` with nothing else in flight, written and read on the caller's
thread with no future (its round trip is a few microseconds over shm, where a future's bookkeeping was most
of it). Over shm's C path the whole call is one C call on state C owns (``shm_lone.c``'s ``LoneCall``, made
by ``Transport.lone_call(LoneParts)``), which hands the rare cases back to ``exchange_alone`` and
``read_alone`` here. Both take the same steps: nothing pending or queued, the reader's token, the send lock
and the next seq under the queue's lock, the write, the read.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import MutableMapping
from operator import itemgetter
from typing import Any, Callable, NamedTuple, Sequence

from rgpu.errors import ConnectionLost, ProtocolError, RemoteError, RgpuError, SessionLost, Timeout

from .wire import Frame, MsgKind, as_bytes_view, encode_prefix, pack_meta, writable_view

STATS = ("messages", "round_trips", "bytes_out", "bytes_in")


class Exchange:
    """The exchange state of a connection whose transport has no C lone call (see the module's docstring).

    Fields, each read and written under the lock its user documents: ``reading`` (bool), ``waiters`` (int),
    ``sending_seq`` (int), ``dead`` (the ``RgpuError`` that ended the connection, or None), ``async_error``
    ((seq, ``RemoteError``) of a failed post, or None), and the counters of ``STATS``. ``next_seq()``: 1, 2, ...
    """

    __slots__ = ("next_seq", "reading", "waiters", "sending_seq", "dead", "async_error", *STATS)

    def __init__(self):
        self.next_seq = itertools.count(1).__next__   # a C call, as the LoneCall's next_seq
        self.reading = False
        self.waiters = self.sending_seq = 0
        self.dead = self.async_error = None
        self.messages = self.round_trips = self.bytes_out = self.bytes_in = 0

    def sent(self, nbytes: int) -> None:
        """One frame of ``nbytes`` buffer bytes counted."""
        self.messages += 1
        self.bytes_out += nbytes


class Counts(MutableMapping):
    """``Connection.stats``: the exchange's counters as a dict-like view (read, compared, adjusted in place).

    Keys: ``messages``, ``round_trips``, ``bytes_out``, ``bytes_in``; any other is a ``KeyError``.
    """

    __slots__ = ("_state",)

    def __init__(self, state):
        self._state = state

    def __getitem__(self, key: str) -> int:
        if key not in STATS:
            raise KeyError(key)
        return getattr(self._state, key)

    def __setitem__(self, key: str, value: int) -> None:
        if key not in STATS:
            raise KeyError(f"{key!r}: a connection counts only {', '.join(STATS)}")
        setattr(self._state, key, value)

    def __delitem__(self, key: str) -> None:
        raise TypeError("a connection's counters cannot be removed")

    def __iter__(self):
        return iter(STATS)

    def __len__(self) -> int:
        return len(STATS)

    def __repr__(self) -> str:
        return repr(dict(self))


# The router of replies

_REPLY, _ERROR, _REQUEST = MsgKind.REPLY, MsgKind.ERROR, MsgKind.REQUEST


class Reply(tuple):
    """A request's answer: ``meta`` and ``buffers`` (pool memory until ``release()``).

    A tuple of (meta, buffers, frame), so that shm's C path (``shm_lone.c``) makes one through the
    tuple's own constructor, knowing nothing of this class's layout. ``frame``: what the buffers are
    leased from; None where they are the caller's own (copied into ``reply_into``).
    """

    __slots__ = ()

    def __new__(cls, meta: Any, buffers: list, frame: Frame | None = None):
        return tuple.__new__(cls, (meta, buffers, frame))

    meta = property(itemgetter(0), doc="the answer's metadata (any msgpack value)")
    buffers = property(itemgetter(1), doc="the answer's buffers: memoryviews, valid until release()")
    frame = property(itemgetter(2), doc="the received frame holding the buffers, or None")

    def release(self) -> None:
        """Hand the buffers back (pool leases, shm's shared memory); safe to call twice."""
        frame = self[2]
        if frame is not None:
            frame.release()


class Future:
    """The pending answer to one request; ``result()`` waits (and may do the reading)."""

    __slots__ = ("_router", "seq", "into", "_reply", "_error", "done")

    def __init__(self, router: "ReplyRouter", seq: int, into):
        self._router, self.seq, self.into = router, seq, into
        self._reply: Reply | None = None
        self._error: BaseException | None = None
        self.done = False

    def result(self, timeout: float | None = None) -> Reply:
        """The answer, waiting up to ``timeout`` seconds (None: as long as it takes; ``Timeout`` after).
        Raises the server's ``RemoteError`` for this request, or for a post sent before it that failed,
        and ``ConnectionLost`` once the connection is gone."""
        router = self._router
        if not self.done:
            router.wait(self, timeout)
        if router.state.async_error is not None:
            err = router.take_async_error(self.seq)   # a post before this request failed: it wins
            if err is not None:
                raise err
        if self._error is not None:
            raise self._error
        return self._reply


_new = tuple.__new__   # Reply(...) on a reply's path without its Python __new__ (a call fewer)


def _remote_error(meta) -> RemoteError:
    meta = meta if isinstance(meta, dict) else {}
    return RemoteError(str(meta.get("message", "remote call failed")), op=meta.get("op"),
                       remote_type=meta.get("type"))


class ReplyRouter:
    """A connection's receiving half over ``transport``: frames read into ``pool`` leases within ``limits``
    (``wire.Limits``), each reply handed to its future in ``pending`` (by seq); ``state`` is the
    connection's exchange state (the reader's token, the kept error, the counters), ``rcv_lock`` guards
    the token and ``pending`` (``rcv`` its condition), ``request_timeout`` is the default wait (0: none),
    ``fail(exc)`` ends the connection (its ``dead`` is then what every waiter raises)."""

    def __init__(self, transport, limits, pool, state, pending: dict, rcv_lock, rcv, request_timeout: float,
                 fail: Callable[[RgpuError], None]):
        self.transport, self.limits, self.pool, self._x = transport, limits, pool, state
        self.pending, self.rcv_lock, self.rcv = pending, rcv_lock, rcv
        # the seq of the last answer read (answers come in seq order): a lone call's request says it in its
        # ack field, so a resumable session's server forgets the answers kept for a resume (resume_server.py)
        self.answered = 0
        self._request_timeout = request_timeout
        self._fail = fail

    @property
    def state(self):
        return self._x

    def expect(self, fut: Future, seq: int) -> None:
        """``fut`` answers request ``seq`` (called under the write queue's lock, in seq order)."""
        fut.seq = seq
        self.pending[seq] = fut

    def fail_all(self, dead: RgpuError) -> None:
        """The connection failed: every pending future gets ``dead``, every waiting thread wakes."""
        for fut in list(self.pending.values()):
            fut._error, fut.done = dead, True
        self.pending.clear()
        with self.rcv:
            self.rcv.notify_all()

    def read_reply(self, seq: int, into, frame: Frame | None = None) -> Reply:
        """Frames until request ``seq``'s answer (this thread is the reader); earlier posts' errors first."""
        recv, limits, pool = self.transport.recv_frame, self.limits, self.pool
        want = None if into is None else (lambda kind, s, lengths: into if kind is _REPLY and s == seq else None)
        while True:
            if frame is None:
                try:
                    frame = recv(limits, pool, want)
                except RgpuError as exc:
                    self._fail(exc)
                    raise self._x.dead from None
            if frame.seq == seq and (frame.kind is _REPLY or frame.kind is _ERROR):
                break
            try:
                self._dispatch(frame)             # a failed post's error, a BYE
            except RgpuError as exc:
                self._fail(exc)
                raise self._x.dead from None
            frame = None
        self.answered = seq
        bufs = frame.buffers
        if bufs:
            n = 0
            for b in bufs:                        # (a loop: a comprehension is a call more on every reply)
                n += b.nbytes
            self._x.bytes_in += n
        if self._x.async_error is not None:
            err = self.take_async_error(seq)      # a post before this request failed: it wins
            if err is not None:
                frame.release()
                raise err
        if frame.kind is _ERROR:
            frame.release()
            raise _remote_error(frame.meta)
        return _new(Reply, (frame.meta, frame.buffers, frame))

    def drain_while_blocked(self) -> bool | None:
        """The transport's ``on_block``: our write waits on the server; read the replies it may be blocked on."""
        try:
            oldest = next(iter(self.pending), None)
        except RuntimeError:                      # changed under us by the reader: look again next time
            return False
        if oldest is None or oldest >= self._x.sending_seq:
            return None                           # no reply can come before this write ends
        with self.rcv_lock:
            if self._x.reading:
                return False                      # another thread reads for us
            self._x.reading = True
        try:
            if self.transport_readable(0):
                self._dispatch(self.transport.recv_frame(self.limits, self.pool, self._into_for))
        finally:
            self.end_read()
        return True

    def read_acks(self) -> None:
        """A resuming transport's ``on_acks``: its replay log fills; read what has arrived (the server's
        acknowledgements, replies due), never waiting, unless another thread reads already."""
        with self.rcv_lock:
            if self._x.reading:
                return
            self._x.reading = True
        try:
            while self.transport_readable(0):
                self._dispatch(self.transport.recv_frame(self.limits, self.pool, self._into_for))
        finally:
            self.end_read()

    def wait(self, fut: Future, timeout: float | None) -> None:
        if timeout is None and self._request_timeout > 0:
            timeout = self._request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done:
            with self.rcv_lock:
                if fut.done:
                    break
                if self._x.reading:                 # another thread reads: it will hand us our reply
                    self._x.waiters += 1
                    try:
                        self.rcv.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    finally:
                        self._x.waiters -= 1
                    if deadline is not None and time.monotonic() >= deadline and not fut.done:
                        raise Timeout(f"no answer to request {fut.seq} within {timeout} s")
                    continue
                self._x.reading = True
            try:
                if deadline is not None and not self.transport_readable(deadline - time.monotonic()):
                    raise Timeout(f"no answer to request {fut.seq} within {timeout} s")
                self._dispatch(self.transport.recv_frame(self.limits, self.pool, self._into_for))
            except Timeout:
                raise
            except RgpuError as exc:
                self._fail(exc)
            finally:
                self.end_read()

    def end_read(self) -> None:
        with self.rcv_lock:
            self._x.reading = False
            if self._x.waiters:
                self.rcv.notify_all()

    def transport_readable(self, timeout: float) -> bool:
        return self.transport.readable(max(0.0, timeout))

    def _into_for(self, kind: int, seq: int, lengths: list):
        fut = self.pending.get(seq) if kind is _REPLY else None
        return fut.into if fut is not None else None

    def _dispatch(self, frame: Frame) -> None:
        if frame.buffers:
            self._x.bytes_in += sum([b.nbytes for b in frame.buffers])
        if frame.kind is _REPLY:  # the common case first
            fut = self.pending.pop(frame.seq, None)
            if fut is not None:
                fut._reply = _new(Reply, (frame.meta, frame.buffers, frame))
                fut.done = True
                self.answered = frame.seq
                return
        if frame.kind is _REPLY or frame.kind is _ERROR:  # (a reply to no request: refused below)
            fut = self.pending.pop(frame.seq, None)
            if fut is None:
                frame.release()
                if frame.seq == 0:                # an acknowledgement (transport/resume.py read its ack)
                    return
                if frame.kind == MsgKind.ERROR:   # a post failed: raise at the next wait
                    if self._x.async_error is None:
                        self._x.async_error = (frame.seq, _remote_error(frame.meta))
                    return
                raise ProtocolError(f"seq: reply to unknown request {frame.seq}")
            if frame.kind == MsgKind.ERROR:
                frame.release()
                fut._error = _remote_error(frame.meta)
            else:
                fut._reply = Reply(frame.meta, frame.buffers, frame)
            fut.done = True
        elif frame.kind == MsgKind.BYE:
            meta = frame.meta if isinstance(frame.meta, dict) else {}
            reason = meta.get("reason") or "no reason given"
            if meta.get("error") == "ProtocolError":  # the server refused a frame of ours
                raise ProtocolError(f"the server closed the session: {reason}")
            raise SessionLost(f"the server ended the session: {reason}")
        else:
            frame.release()
            raise ProtocolError(f"kind: unexpected {frame.kind.name} from the server")

    def why_lost(self, exc: RgpuError) -> RgpuError:
        """A write failed: a BYE the server sent before hanging up says why (a frame over its limit, say)."""
        if not isinstance(exc, ConnectionLost):
            return exc
        with self.rcv_lock:
            if self._x.reading:
                return exc
            self._x.reading = True
        try:
            for _ in range(64):  # replies queued before the BYE are handed out on the way
                if not self.transport_readable(0):
                    break
                self._dispatch(self.transport.recv_frame(self.limits, self.pool, self._into_for))
        except (ProtocolError, SessionLost) as reason:
            return reason
        except RgpuError:
            pass
        finally:
            self.end_read()
        return exc

    def raise_async_error(self) -> None:
        err = self.take_async_error()
        if err is not None:
            raise err
        if self._x.dead:
            raise self._x.dead

    def take_async_error(self, before: int | None = None) -> RemoteError | None:
        """The kept error of a failed post (only one sent before ``before``), forgotten once taken."""
        kept = self._x.async_error
        if kept is None or (before is not None and kept[0] >= before):
            return None
        self._x.async_error = None
        return kept[1]


# The lone call


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
