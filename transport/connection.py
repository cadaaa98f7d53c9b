"""A client's connection: ordered posts written by an I/O thread, requests that return futures.

- ``post()`` never waits on the socket: frames queue up and a background thread
  writes whatever has gathered in one scatter/gather ``send`` (bounded by count and
  bytes). Small buffers are copied at the call; big ones are written before
  ``post()`` returns, so the caller may always reuse its memory afterwards. The
  policy comes from the transport's declared ``Capabilities``: with a
  ``batch_window_s`` (tcp), small posts gather that long and the caller writes them
  itself, the background thread only what sat longer; with ``writes_inline`` (shm:
  a write is a memory copy), each is written at once.
- ``request()`` writes on the caller's thread when nothing is queued (a thread
  hand-off costs a cross-core wake-up each way); ``call()`` of a lone request
  writes and reads on the caller's thread with no future at all (over shm, the
  whole of it in one C call: ``shm_lone.c``).

A ``Connection`` is composed of parts, each given what it needs when made: its exchange state
(``exchange.py``'s ``Exchange``: the sequence, the reader's token, why it died, a post's kept error, the counters;
over shm with its C path a C object, ``shm_lone.c``), the ``WriteQueue`` here (frames in order to
the transport), the ``ReplyRouter`` (``exchange.py`` too: replies to their futures, a failed
post's error, the reading while a write is blocked) and the ``LoneCaller`` (``exchange.py`` as well).
The deque, dict and locks that more than one part looks at are made here and handed to each.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from rgpu.errors import ConnectionLost, ProtocolError, RgpuError, Timeout, VersionMismatch

from .base import Transport
from .exchange import Counts, Exchange, Future, LoneCaller, LoneParts, Reply, ReplyRouter
from .wire import BufferPool, Limits, MsgKind, as_bytes_view, copied, encode_prefix, writable_view

__all__ = ["Connection", "Future", "Reply"]

_POST, _REQUEST = MsgKind.POST, MsgKind.REQUEST
POST_FLUSH_COUNT = 32   # gathered posts the caller writes at once, whatever their age (transports with a batch window)
# ... and gathered bytes: copying this many dwarfs a syscall, and holding them only kept the server waiting
# (a training step's batch, 128 KiB, waited out the window at the step's start while the GPU sat idle)
POST_FLUSH_BYTES = 64 << 10
IO_SLACK_MAX_S = 2e-3   # how long past the window a gathering I/O thread may leave frames of a caller gone quiet


def _packed_parts(seq: int, meta: bytes, views) -> list:
    """A POST frame of packed metadata (and buffers) as plain parts, which every transport's ``send`` takes."""
    return [encode_prefix(_POST, seq, 0, meta, [v.nbytes for v in views]), *views]


class WriteQueue:
    """A connection's frames, in seq order, to ``transport``: posts queued or written on the caller's thread
    as the transport's ``Capabilities`` say, requests written at once when nothing is ahead, the rest by an
    I/O thread. Given: ``settings`` (the batch and queue bounds), ``state`` (the exchange state: the
    sequence, ``dead``, the counters, the seq being written), ``queue`` (a deque of (parts, nbytes,
    written-event or None, seq)), ``cv_lock`` (guards the queue, the seq order and the writer's state) and
    ``send_lock`` (held by whoever writes to the transport), ``expect(fut, seq)`` (a request's future
    registered with the router, under ``cv_lock``), ``lost(exc)`` (a write failed: the error to raise) and
    ``fail(exc)`` (the connection ends). Every method raises the connection's ``dead`` once it failed."""

    def __init__(self, transport: Transport, settings, state, queue: deque, cv_lock, send_lock,
                 expect: Callable, lost: Callable, fail: Callable):
        self.transport, self.settings, self._x = transport, settings, state
        self.queue, self.cv_lock, self.send_lock = queue, cv_lock, send_lock
        self._expect, self._lost, self._fail = expect, lost, fail
        self._cv = threading.Condition(cv_lock)   # C-level `with` on cv_lock on the hot path; Condition's is Python
        self._queued_bytes = 0
        self._io_thread: threading.Thread | None = None
        self.closing = False                      # close() began: the I/O thread ends once the queue is empty
        # read on every call: plain attributes, not a dataclass lookup each time (settings are frozen)
        self._copy_bytes, self._queue_max = settings.post_copy_bytes, settings.queue_max_bytes
        caps = transport.capabilities
        self._posts_inline = caps.writes_inline
        # Where the transport has a batch window (tcp), small posts gather and the caller writes them
        # itself once the oldest has waited that long (or POST_FLUSH_COUNT have), a request takes them
        # along, and the I/O thread writes only what sat longer (the caller went quiet): a hand-off to
        # it per post cost GIL hand-offs a post (docs/perf/fast_path-history.md), a write per post a syscall each.
        # A post on a connection quiet for that long goes at once: the server is idle (a training
        # step's first message, after the last one's .item()), and gathering would only delay it; the
        # caller's next batches then go at 2, 4, 8... frames up to POST_FLUSH_COUNT, so the server has
        # work at once while the client's stream builds up (a fast start).
        self.batch_s = None if self._posts_inline else caps.batch_window_s
        self._queue_since = 0.0                   # when the oldest queued frame was queued
        self.wrote_at = 0.0                       # when the last write ended: a quiet connection gathers nothing
        self._flush_at = POST_FLUSH_COUNT         # frames the caller's next batch waits for (the fast start's)
        self._io_idle = False                     # the I/O thread waits for a first frame (a notify wakes it)
        self._urgent = False                      # a queued frame someone waits on (a request, a big post)
        self._flushing = 0                        # threads in flush()

    def post(self, meta: Any, buffers: Sequence = ()) -> int:
        """Send a call that needs no answer; returns its sequence number.

        ``meta``: any msgpack value (``TypeError`` from msgpack, before anything is sent, for others);
        ``buffers``: bytes-like or CPU tensors, reusable by the caller once this returns (small ones are
        copied, big ones written first). Blocks while more than ``RGPU_QUEUE_MAX_BYTES`` are queued. A
        failure on the server comes back later, at the next ``request()`` (``RemoteError``).
        """
        return self.submit(_POST, meta, buffers, None)

    def post_packed(self, meta: bytes, buffers: Sequence = ()) -> int:
        """``post()`` of metadata that is already msgpack (the device's C++ fast path packs its ops itself).

        Buffers are copied at the call, so only small ones belong here (shm would name pinned
        memory rather than copy it, and the caller may change it once we return). On a
        transport that writes on the caller's thread, the frame goes through ``send_meta``:
        no parts list, no prefix bytes object, the buffers copied once, into the ring (shm).
        """
        nbytes = sum([as_bytes_view(b).nbytes for b in buffers]) if buffers else 0
        views = None if self._posts_inline or not buffers else copied(buffers)   # copied at the call
        inline, gathered = False, None
        with self.cv_lock:
            seq = self._admit()
            self._x.sent(nbytes)
            if self._posts_inline and not self.queue and self.send_lock.acquire(blocking=False):
                inline = True                     # nothing ahead of us: write on this thread
            else:
                if views is None:                 # copied here, under the lock, only when shm's queue is busy
                    views = copied(buffers) if buffers else ()
                self._enqueue(_packed_parts(seq, meta, views), nbytes, None, seq)
                if self.batch_s is not None:
                    gathered = self._take_if_due()
        if gathered:
            self._write_gathered(gathered)
        elif inline:
            self._write_inline(seq, self.transport.send_meta, _POST, seq, meta, buffers)
        return seq

    def submit(self, kind: MsgKind, meta, buffers: Sequence, fut: Future | None) -> int:
        views = [as_bytes_view(b) for b in buffers]
        nbytes = 0
        for v in views:
            nbytes += v.nbytes
        big = nbytes > self._copy_bytes
        if views and not big and kind is _POST:
            views = [memoryview(bytearray(v)) for v in views]  # the caller may change its memory once we return
        written = threading.Event() if big else None
        inline, ahead, gathered = False, None, None
        with self.cv_lock:
            seq = self._admit()
            if ((kind is _REQUEST or big or self._posts_inline) and (not self.queue or self.batch_s is not None)
                    and self.send_lock.acquire(blocking=False)):
                inline = True                     # nothing ahead of us, or what is ahead goes first: write it here
                ahead = self._take_all() if self.queue else None
            elif views and not big and kind is _REQUEST:
                views = [memoryview(bytearray(v)) for v in views]  # queued: the caller may change its memory
            try:
                parts = self.transport.frame_parts(kind, seq, 0, meta, views)
            except BaseException:                 # metadata msgpack cannot encode: nothing was sent
                if inline:
                    self.send_lock.release()
                raise
            if fut is not None:
                self._expect(fut, seq)
            self._x.sent(nbytes)
            if not inline:
                self._enqueue(parts, nbytes, written, seq, urgent=written is not None or kind is _REQUEST)
                if self.batch_s is not None and kind is _POST:
                    gathered = self._take_if_due()
        if inline:
            if ahead:
                self._write_gathered(ahead, parts, seq)
            else:
                self._write_inline(seq, self.transport.send, parts)
        elif gathered:
            self._write_gathered(gathered)
        if not inline and written is not None:
            while not written.wait(0.5):
                if self._x.dead:
                    raise self._x.dead
        return seq

    def _admit(self) -> int:
        """The next sequence number, once the queue has room (called with ``_cv_lock`` held)."""
        x = self._x
        if x.dead:
            raise x.dead
        if self._queued_bytes > self._queue_max:
            while self._queued_bytes > self._queue_max and not x.dead:
                self._cv.wait()                   # backpressure: the I/O thread is behind
            if x.dead:
                raise x.dead
        return x.next_seq()

    def _enqueue(self, parts: list, nbytes: int, written, seq: int, urgent: bool = False) -> None:
        """Hand a frame to the I/O thread (called with ``_cv_lock`` held)."""
        first = not self.queue
        self.queue.append((parts, nbytes, written, seq))
        self._queued_bytes += nbytes
        self._ensure_io_thread()
        if first:
            self._queue_since = time.perf_counter()
        # gathering: the I/O thread is woken only from its idle wait (each wake takes the GIL from the caller)
        if self.batch_s is None or urgent or (first and self._io_idle):
            self._urgent = self._urgent or urgent
            self._cv.notify_all()

    def _take_if_due(self) -> list | None:
        """(With ``_cv_lock`` held, gathering.) The queued frames for this caller to write, when the oldest has
        waited the batch window, or there are ``_flush_at`` (1 when the one queued found the connection quiet
        that long, doubling batch by batch up to POST_FLUSH_COUNT) or POST_FLUSH_BYTES, and no one else is
        writing; else None."""
        n, now = len(self.queue), time.perf_counter()
        if n == 1 and now - self.wrote_at >= self.batch_s:
            self._flush_at = 1
        if ((n < self._flush_at and self._queued_bytes < POST_FLUSH_BYTES and now - self._queue_since < self.batch_s)
                or not self.send_lock.acquire(blocking=False)):
            return None
        self._flush_at = min(2 * self._flush_at, POST_FLUSH_COUNT)
        return self._take_all()

    def _take_all(self) -> list:
        """(With ``_cv_lock`` held.) Every queued frame, out of the queue, for the send-lock holder to write."""
        items = list(self.queue)
        waiting = self._queued_bytes > self._queue_max or self._flushing   # a post held back, or flush()
        self.queue.clear()
        self._queued_bytes = 0
        self._urgent = False
        if waiting:   # never the gathering I/O thread: woken, it would only take the GIL to find nothing
            self._cv.notify_all()
        return items

    def _write_gathered(self, items: list, parts: list | None = None, seq: int | None = None) -> None:
        """Write taken frames (and then ``parts``, frame ``seq``) in one send; this thread holds the send lock."""
        out = [p for item in items for p in item[0]]
        if parts is not None:
            out.extend(parts)
        self._write_inline(items[-1][3] if seq is None else seq, self.transport.send, out)
        for _, _, written, _ in items:
            if written is not None:
                written.set()

    def _write_inline(self, seq: int, write, *args):
        """``write(*args)`` on this thread, which holds the send lock (released here); returns what it returns."""
        try:
            self._x.sending_seq = seq
            return write(*args)
        except RgpuError as exc:
            raise self._lost(exc) from None
        finally:
            self.wrote_at = time.perf_counter()
            self.send_lock.release()

    def _ensure_io_thread(self) -> None:
        if self._io_thread is None:
            self._io_thread = threading.Thread(target=self._io_loop, name="rgpu-io", daemon=True)
            self._io_thread.start()

    def _io_loop(self) -> None:
        try:
            self._write_queued()
        except BaseException as exc:   # a bug here must end the connection with a reason, never hang its callers
            self._fail(ConnectionLost(f"the connection's I/O thread failed: {type(exc).__name__}: {exc}"))
            raise

    def _write_queued(self) -> None:
        max_count, max_bytes = self.settings.post_batch_count, self.settings.post_batch_bytes
        slack = self.batch_s or 0.0
        while True:
            with self._cv:
                while not self.queue and not self._x.dead and not self.closing:
                    self._io_idle = True
                    self._cv.wait()
                self._io_idle = False
                if self._x.dead or (self.closing and not self.queue):
                    return
                if self.batch_s is not None and not (self._urgent or self.closing):
                    # gathering: the caller writes its posts as they gather; ours are what sat longer. Frames
                    # younger than that (the caller wrote the older ones meanwhile) are left to the caller: a
                    # write here splits its batches and takes the GIL from it (GPU host: ~26 a step did). While
                    # the caller keeps writing its own, we look less and less often (each look takes the GIL)
                    self._cv.wait(max(0.0, self._queue_since + self.batch_s - time.perf_counter()) + slack)
                    if not self.queue or (not (self._urgent or self.closing)
                                           and time.perf_counter() - self._queue_since < self.batch_s):
                        slack = min(2 * slack, IO_SLACK_MAX_S)
                        continue
                slack = self.batch_s or 0.0
            with self.send_lock:
                with self._cv:
                    if not self.queue:
                        continue                  # a caller wrote them while we waited for the send lock
                    batch, size = [], 0
                    while self.queue and len(batch) < max_count and (not batch or size < max_bytes):
                        item = self.queue.popleft()
                        batch.append(item)
                        size += item[1]
                    self._queued_bytes -= size
                    self._urgent = self._urgent and bool(self.queue)
                    if self.queue:
                        self._queue_since = time.perf_counter()
                    self._cv.notify_all()
                try:
                    self._x.sending_seq = batch[-1][3]
                    self.transport.send([p for parts, _, _, _ in batch for p in parts])
                except RgpuError as exc:
                    self._lost(exc)
                    return
                self.wrote_at = time.perf_counter()
            for _, _, written, _ in batch:
                if written is not None:
                    written.set()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued frame has been written (``Timeout`` after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._flushing += 1
            try:
                if self.queue:
                    self._urgent = True           # a gathering I/O thread writes now, not after the window
                    self._cv.notify_all()
                while self.queue and not self._x.dead:
                    left = 0.5 if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout(f"{len(self.queue)} frames still queued after {timeout} s")
                    self._cv.wait(min(0.5, left))
            finally:
                self._flushing -= 1
        if not self.send_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise Timeout(f"a write still in progress after {timeout} s")
        self.send_lock.release()
        if self._x.dead:
            raise self._x.dead

    def fail(self, exc: RgpuError) -> RgpuError:
        """Keep why the connection ended (the first reason; what does not name a cause is ``ConnectionLost``)
        and wake every thread waiting to queue or flush; returns the kept error."""
        x = self._x
        with self._cv:
            if x.dead is None:
                keep = isinstance(exc, (ConnectionLost, ProtocolError, VersionMismatch))
                x.dead = exc if keep else ConnectionLost(str(exc))
                x.dead.__cause__ = None if keep else exc
            self._cv.notify_all()
        return x.dead

    def say_bye(self) -> None:
        """A BYE after everything queued (the caller flushed): the server ends the session at once."""
        with self.send_lock:
            self.transport.send(self.transport.frame_parts(MsgKind.BYE, self._x.next_seq(), 0, None, []))


class Connection:
    """One session's client end over ``transport`` (handshake done; ``welcome`` the server's dict), from
    ``settings`` (``rgpu.config``): frames within ``limits`` (default: the settings'), received buffers
    leased from ``pool``.

    Thread-safe: any thread may post, request or call. It owns the transport from here on: it sets the
    transport's ``on_block`` and ``on_acks`` and is the only one to send, receive or close on it. Every
    method raises ``ConnectionLost`` (or the ``ProtocolError``/``SessionLost`` that ended it) once the
    connection has failed or was closed. ``post(meta, buffers)`` and ``post_packed(meta, buffers)`` are
    its write queue's (bound here: no call between), ``stats`` counts messages, round_trips, bytes_out
    and bytes_in (a dict-like view; adjusting a count in place is allowed).
    """

    def __init__(self, transport: Transport, settings, welcome: dict | None = None,
                 limits: Limits | None = None, pool: BufferPool | None = None):
        self._transport = transport
        self.welcome = welcome or {}
        self.settings = settings
        self.limits = limits or Limits.from_settings(settings)
        self.pool = pool or BufferPool()
        # what more than one part looks at (the lone call checks the queue and pending, takes the locks)
        queue, pending = deque(), {}
        cv_lock, send_lock, rcv_lock = threading.Lock(), threading.Lock(), threading.Lock()
        rcv = threading.Condition(rcv_lock)
        caps = transport.capabilities
        # The exchange state, one owner: over shm with its C path a C object that is also call()'s whole
        # lone request (shm_lone.c), else exchange.py's; a transport that gathers posts has no lone call
        lone_call = transport.lone_call if caps.writes_inline or caps.batch_window_s is None else None
        if lone_call is None:
            self._x = Exchange()
        else:
            self._x = lone_call(LoneParts(self.limits, pending, queue, rcv_lock, rcv, cv_lock, send_lock,
                                          self._exchange_alone, self._read_alone, self._lost))
        self.router = ReplyRouter(transport, self.limits, self.pool, self._x, pending, rcv_lock, rcv,
                                  settings.request_timeout, self._fail)
        self.writes = WriteQueue(transport, settings, self._x, queue, cv_lock, send_lock, self.router.expect,
                                 self._lost, self._fail)
        self._lone_py = LoneCaller(self.writes, self.router, transport, self._x, self._lost)
        self._lone = self._x if lone_call is not None else self._lone_py._call_alone
        self._request_timeout = settings.request_timeout
        self.post, self.post_packed = self.writes.post, self.writes.post_packed
        self.stats = Counts(self._x)
        transport.on_block = self.router.drain_while_blocked
        transport.on_acks = self.router.read_acks  # called by a resuming transport (resume.py) only

    @property
    def transport(self) -> Transport:
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        """A live connection's transport replaced by one wrapping it (``delay.set_rtt``), for every part."""
        self._transport = self.writes.transport = self.router.transport = self._lone_py.transport = transport

    @property
    def transport_name(self) -> str:
        """Which transport carries the session: "tcp", "shm" or "ucx" (a wrapper's, such as delay's, is its inner's)."""
        return self.transport.name

    def request(self, meta: Any, buffers: Sequence = (), reply_into: Sequence[memoryview] | None = None) -> Future:
        """Send a call and return the future of its answer (``Future.result(timeout)`` waits for the ``Reply``).

        ``meta``: any msgpack value (``TypeError`` before anything is sent for others); ``buffers``:
        bytes-like or CPU tensors, left alone until the answer came; ``reply_into``: writable, contiguous
        caller memory the answer's buffers land in when their sizes match (``TypeError`` before anything
        is sent otherwise). Raises first the kept ``RemoteError`` of an earlier failed post, if any.
        """
        if reply_into is not None:
            reply_into = [writable_view(b) for b in reply_into]  # refused here, not halfway through a read
        x = self._x
        if x.async_error is not None or x.dead is not None:
            self.router.raise_async_error()
        fut = Future(self.router, 0, reply_into)
        x.round_trips += 1
        self.writes.submit(_REQUEST, meta, buffers, fut)
        return fut

    def call(self, meta: Any, buffers: Sequence = (), reply_into=None, timeout: float | None = None,
             sent: Callable[[], None] | None = None) -> Reply:
        """``request(...).result(timeout)``: the ``Reply`` (``release()`` it), ``RemoteError`` when the server's
        handler failed, ``Timeout`` past ``timeout`` (or ``RGPU_TIMEOUT``). With nothing else in
        flight it is written and read on this thread with no future (``exchange.py``'s ``LoneCaller``).

        ``sent()``: called once, when the request has been written (or queued for the writer), before its
        answer is awaited; not at all when the call raises before that (a caller's lock held for the send's
        order only is released there: the CUDA route's client)."""
        if timeout is None and not self._request_timeout:
            reply = self._lone(meta, buffers, reply_into, sent)
            if reply is not None:
                return reply
        fut = self.request(meta, buffers, reply_into)
        if sent is not None:
            sent()
        return fut.result(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued frame has been written (``Timeout`` after ``timeout`` seconds)."""
        self.writes.flush(timeout)

    def take_async_error(self, before: int | None = None):
        """The kept ``RemoteError`` of a failed post (only one sent before seq ``before``), forgotten once taken."""
        return self.router.take_async_error(before)

    # the lone call's rare cases, as the C lone call is given them (it is made before the parts they use)
    def _exchange_alone(self, seq: int, packed: bytes, buffers: Sequence, reply_into, sent=None) -> Reply:
        return self._lone_py._exchange_alone(seq, packed, buffers, reply_into, sent)

    def _read_alone(self, seq: int, reply_into, frame) -> Reply:
        return self._lone_py._read_alone(seq, reply_into, frame)

    # ---- failure and close -------------------------------------------------------------

    def _lost(self, exc: RgpuError) -> RgpuError:
        """A write or read failed: the connection is lost; the error to raise (a BYE read meanwhile names why)."""
        self._fail(self.router.why_lost(exc))
        return self._x.dead

    def _fail(self, exc: RgpuError) -> None:
        """The connection is unusable: every waiter and later call gets ``exc``."""
        self.router.fail_all(self.writes.fail(exc))
        self.transport.abort()

    @property
    def alive(self) -> bool:
        """False once the connection failed or was closed (every call then raises why)."""
        return self._x.dead is None

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued and say BYE (within ``timeout``, default the connect timeout), then end.

        Threads still waiting for an answer get ``ConnectionLost``; so does every later call.
        """
        writes = self.writes
        if writes.closing:
            return
        writes.closing = True
        try:
            if self._x.dead is None:
                writes.flush(self.settings.connect_timeout if timeout is None else timeout)
                writes.say_bye()
        except RgpuError:
            pass
        finally:
            self._fail(ConnectionLost("the connection was closed"))
            self.transport.close()

    # the parts' state under the names tests and bench/client_profile.py look at
    _queue = property(lambda self: self.writes.queue)
    _queued_bytes = property(lambda self: self.writes._queued_bytes)
    _batch_s = property(lambda self: self.writes.batch_s)
    _io_thread = property(lambda self: self.writes._io_thread)
    _io_idle = property(lambda self: self.writes._io_idle)
    _cv = property(lambda self: self.writes._cv)
    _call_alone = property(lambda self: self._lone_py._call_alone)
    _write_queued = property(lambda self: self.writes._write_queued,
                             lambda self, fn: setattr(self.writes, "_write_queued", fn))
