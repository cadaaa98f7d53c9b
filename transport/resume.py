"""Sessions that outlive a dropped tcp connection: the client's end (reconnect, re-authenticate, resume, replay).

``ResumingTransport`` wraps the session's ``TcpTransport`` when the server's WELCOME offers a resume
id (``RGPU_SESSION_GRACE`` > 0 on the server, plain tcp). The connection above it never sees a drop:

- every frame sent is kept (``replay_log.py``: by reference, the caller's memory copied) until the server
  acknowledges it (the ``ack`` field of its replies, or a REPLY of seq 0 the server sends every so often
  during a stretch of posts; a reader notes the ack, the next send forgets what it covers), at most
  ``RGPU_REPLAY_BYTES``: past it a send waits a moment for acknowledgements, as a full socket would,
  then the oldest go (a frame over the bound by itself is never kept), and a drop before the server
  acknowledges them ends the session;
- a send or a read that fails reconnects with backoff, authenticates again (the handshake's HMAC),
  resumes by the id with the seq of the last answer it read, and writes again every kept frame past
  the seq the server says it applied; the server re-sends the answers past ours;
- when that cannot be done (the grace passed, the id refused, the replay bound crossed) the
  failure is ``SessionLost`` naming why, raised out of the send or read, so the next wait raises it.

Frames are ``frame_parts``' shape: a prefix part (header, lengths, metadata), then one part per buffer.
The server's end is ``resume_server.py``.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import ssl
import threading
import time
import weakref
from collections import deque
from threading import get_ident
from typing import Callable, Sequence

from rgpu.errors import AuthenticationError, ConnectionLost, ProtocolError, RgpuError, SessionLost

from . import tcp
from .base import Transport
from .replay_log import ReplayLog
from .wire import MsgKind

_REPLY, _ERROR, _BYE, _POST = MsgKind.REPLY, MsgKind.ERROR, MsgKind.BYE, MsgKind.POST
BACKOFF_S = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)   # between reconnection attempts; the last repeats
ACK_WAIT_S = 5.0   # a send over the bound waits this long for acknowledgements (a server busy longer: shed)


def grace_of(offer: dict, settings) -> float:
    """The seconds the server keeps a dropped session (its WELCOME's offer says; else this client's setting)."""
    return float(offer.get("grace_s") or settings.session_grace)


def dead_after(grace_s: float) -> float:
    """How soon a silent link is given up on (``tcp.tune``): within half the session's grace, so the resume
    still finds the session (a write blocked on a dead link waited the kernel's 60 s, past a 30 s grace)."""
    return min(tcp.DEAD_AFTER_S, max(2.0, grace_s / 2))


class ResumingTransport(Transport):
    """A tcp transport that reconnects and resumes its session when the connection drops (see the module)."""
    name = "tcp"

    def __init__(self, inner, offer: dict, dial: Callable[[dict, float], tuple], settings, where: str):
        self._inner = inner
        self._id = str(offer["id"])
        self.grace_s = grace_of(offer, settings)
        self.log = ReplayLog(settings.replay_bytes, settings.post_copy_bytes)
        self._half = self.log.bound // 2      # past it a send reads the server's acknowledgements
        self._dial, self._where, self._settings = dial, where, settings
        self.received = 0                     # the seq of the last answer (REPLY or ERROR) read
        self.acked = 0                        # the highest ack read (a reader's note; the writer trims the log)
        self._gen = 0                         # connections so far: a failure on an older one is handled
        self._wlock = threading.Lock()        # held from a frame's keeping to its write (never re-entered)
        self._rlock = threading.Lock()        # held by the thread that resumes
        self._writer: int | None = None       # the thread in send (its reads never resume: its send does)
        self._stash: deque = deque()          # frames read while the replay was being written
        self._lost: RgpuError | None = None   # why the session cannot go on (SessionLost, a server's BYE)
        self._in_recv = 0                     # threads reading the connection
        self._closed = False
        self._into = None
        self.on_acks: Callable[[], None] | None = None   # Connection's: read what is readable, not waiting
        self._on_block = None
        self.resumes = 0
        self.capabilities = inner.capabilities   # batching as the tcp below it
        self._said_bye, self._pid = False, os.getpid()
        _say_goodbye_at_exit(self)

    @property
    def tls(self) -> bool:
        return self._inner.tls

    @property
    def spin_s(self) -> float:
        return self._inner.spin_s

    @property
    def sock(self):
        return self._inner.sock

    def tune_reads(self, spin_us, use_c: bool = True) -> None:
        self._inner.tune_reads(spin_us, use_c)

    @property
    def on_block(self):
        return self._on_block

    @on_block.setter
    def on_block(self, hook) -> None:     # the connection's, set once: handed to each connection's tcp end
        self._on_block = self._inner.on_block = hook

    # ---- the contract --------------------------------------------------------------

    def send(self, parts: Sequence) -> None:
        # every call's own path (a lone call's request, each batch of posts): as few steps as it takes; the
        # write lock is held from the frames' keeping to their write, so a replay never overtakes a send.
        # The lock is not re-entrant, so a send never runs inside another on the same thread: ``_writer``
        # only tells a read inside this send (on_block, on_acks) that a drop is this send's to resume
        if self._lost is not None:
            raise self._lost
        wlock, log = self._wlock, self.log
        wlock.acquire()
        self._writer, gen = get_ident(), self._gen
        try:
            # what the readers saw acknowledged is forgotten here, by the log's owner, as it keeps these
            if log.keep(parts, self.acked):
                self._said_bye = True
            self._inner.send(parts)
            if log.added - log.dropped > self._half:
                self._make_room()
            return
        except SessionLost:
            raise
        except ConnectionLost as exc:
            if self._said_bye or self._closed or self._lost is not None:
                raise
            lost = exc
        finally:
            self._writer = None
            wlock.release()
        self._resume(gen, lost)               # replays what we kept, these frames among them

    def recv_frame(self, limits, pool, into=None):
        self._into = into
        while True:
            if self._stash:
                return self._stash.popleft()
            if self._lost is not None:
                raise self._lost
            gen, lost = self._gen, None
            self._in_recv += 1
            try:
                frame = self._inner.recv_frame(limits, pool, into)
            except SessionLost:
                raise
            except ConnectionLost as exc:
                if self._closed or self._writer == get_ident():
                    raise
                lost = exc
            finally:
                self._in_recv -= 1
            if lost is not None:
                self._resume(gen, lost)
                continue
            ack, seq = frame.ack, frame.seq
            if ack > self.acked:
                self.acked = ack
            if seq > self.received and (frame.kind is _REPLY or frame.kind is _ERROR):
                self.received = seq
            return frame

    def _make_room(self) -> None:
        """The log is half full: read the server's acknowledgements (it sends one every so much it reads);
        over the bound, wait for them as a full socket would, at most ACK_WAIT_S (a server busy longer:
        the oldest go, and a drop before the server acknowledges them ends the session)."""
        log = self.log
        if self.on_acks is not None:
            self.on_acks()
            log.trim(self.acked)
            until = time.monotonic() + ACK_WAIT_S
            while log.over() and len(log.frames) > 1 and time.monotonic() < until:
                time.sleep(0.0005)
                self.on_acks()
                log.trim(self.acked)
        if log.over():
            log.shed()

    def _note(self, frame) -> None:
        """What a frame read outside ``recv_frame`` says (its ack, the last answer read), as ``recv_frame`` notes it."""
        if frame.ack > self.acked:
            self.acked = frame.ack
        kind = frame.kind
        if (kind is _REPLY or kind is _ERROR) and frame.seq > self.received:
            self.received = frame.seq

    def readable(self, timeout: float) -> bool:
        return bool(self._stash) or self._lost is not None or self._inner.readable(timeout)

    def drop(self) -> None:
        """Cut the current connection as a network would (tests, ``rgpu bench resilience``): the next send
        or read resumes the session."""
        import socket

        try:
            self._inner.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.goodbye()
        self._closed = True
        self._inner.close()

    def abort(self) -> None:
        self.goodbye()
        self._closed = True
        self._inner.abort()

    def goodbye(self) -> None:
        """Tell the server this client is done with the session (a BYE, if none went yet), so it ends at once
        instead of being held for the grace: at close, abort, exit. Never blocks: a BYE that cannot go at once
        (a write in progress, a full socket, no connection) is left out, and the session is held as a vanished
        client's is."""
        if self._said_bye or self._closed or self._lost is not None or os.getpid() != self._pid:
            return                                # (a forked child's copy of the socket is not its own session)
        if not self._wlock.acquire(blocking=False):
            return
        try:
            if self._writer is None:              # not inside a write of this thread's (a signal's exit)
                bye = b"".join(self._inner.frame_parts(_BYE, 0, 0, {"reason": "the client is done"}, []))
                sock = self._inner.sock
                if isinstance(sock, ssl.SSLSocket):   # (no flags on a TLS socket: a short timeout instead)
                    sock.settimeout(0.5)
                    sock.sendall(bye)
                else:
                    sock.send(bye, socket.MSG_DONTWAIT)
                self._said_bye = True
        except (OSError, ValueError, AttributeError):
            pass
        finally:
            self._wlock.release()

    # ---- resuming ------------------------------------------------------------------

    def _resume(self, gen: int, why: ConnectionLost) -> None:
        """The connection of generation ``gen`` dropped: resume on a new one (or raise ``SessionLost``)."""
        with self._rlock:
            if self._gen != gen:
                return                        # another thread resumed already
            if self._lost is not None:
                raise self._lost
            if self._closed:
                raise why
            if not self._in_recv:             # no reader would see it: a BYE the server sent before it hung up
                self._look_for_bye()
            self._inner.abort()               # a writer blocked on the old socket lets go of the write lock
            with self._wlock:
                try:
                    self._inner = self._reconnect(why)
                except SessionLost as exc:
                    self._lost = exc
                    raise
                self._gen += 1
                self.resumes += 1

    def _look_for_bye(self) -> None:
        """What the old connection still holds: replies (kept for the readers), or a BYE, which ends the
        session with its reason (a frame over the server's limit, the server stopping) instead of a resume."""
        from .wire import BufferPool

        try:
            for _ in range(64):
                if not self._inner.readable(0):
                    return
                frame = self._inner.recv_frame(self._limits(), BufferPool(), self._into)
                if frame.kind is _BYE:
                    meta = frame.meta if isinstance(frame.meta, dict) else {}
                    reason = meta.get("reason") or "no reason given"
                    self._lost = (ProtocolError(f"the server closed the session: {reason}")
                                  if meta.get("error") == "ProtocolError"
                                  else SessionLost(f"the server ended the session: {reason}"))
                    raise self._lost
                self._note(frame)
                self._stash.append(frame)
        except RgpuError as exc:
            if exc is self._lost:
                raise

    def _reconnect(self, why: ConnectionLost):
        deadline = time.monotonic() + self.grace_s
        attempt, last = 0, why
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionLost(f"the connection to {self._where} dropped ({why}) and the session could not be "
                                  f"resumed within its grace of {self.grace_s:g} s (RGPU_SESSION_GRACE): {last}")
            try:
                t, welcome = self._dial({"resume": self._id, "received": self.received},
                                        min(left, self._settings.connect_timeout))
            except SessionLost:
                raise
            except AuthenticationError as exc:
                raise SessionLost(f"the session could not be resumed: {exc}") from None
            except RgpuError as exc:
                last = exc
            else:
                try:
                    return self._replay(t, welcome)
                except SessionLost:
                    t.abort()
                    raise
                except ConnectionLost as exc:
                    t.abort()
                    last = exc
            time.sleep(min(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)], max(0.0, deadline - time.monotonic())))
            attempt += 1

    def _replay(self, t, welcome: dict):
        """On the resumed connection ``t``: write again what the server had not applied."""
        resumed = welcome.get("resumed") if isinstance(welcome.get("resumed"), dict) else {}
        applied = resumed.get("applied")
        if not isinstance(applied, int):
            raise SessionLost(f"the server at {self._where} did not resume the session (it answered {welcome!r})")
        if self.log.gap > applied:
            self._bye(t, "the client could not replay what the server had not applied")
            raise SessionLost(f"the session could not be resumed: frames up to seq {self.log.gap} that the server had "
                              f"not acknowledged were past the replay bound of {self.log.bound} bytes "
                              "(RGPU_REPLAY_BYTES) and are gone")
        parts = self.log.after(applied)
        t.on_block = lambda: self._stash_from(t)   # answers the server re-sends meanwhile are read, kept
        if parts:
            t.send(parts)
        t.on_block = self.on_block
        return t

    def _stash_from(self, t) -> bool:
        from .wire import BufferPool

        if t.readable(0):
            frame = t.recv_frame(self._limits(), BufferPool(), self._into)
            self._note(frame)
            self._stash.append(frame)
        return True

    def _limits(self):
        from .wire import Limits

        return Limits.from_settings(self._settings)

    @staticmethod
    def _bye(t, reason: str) -> None:
        try:
            t.send(t.frame_parts(_BYE, 0, 0, {"reason": reason}, []))
        except RgpuError:
            pass


# ---- goodbyes at exit ----------------------------------------------------------------

_live: "weakref.WeakSet[ResumingTransport]" = weakref.WeakSet()
_exit_hooks: list = []


def _say_goodbye_at_exit(t: ResumingTransport) -> None:
    """A resumable session's server holds it for the grace when its connection drops, so a client that exits
    says goodbye: at interpreter exit (an exception that ends the program too), and on SIGTERM where the
    program left it at its default (it becomes ``SystemExit``, so the exit runs). Only a client killed
    outright (SIGKILL, its machine or network gone) leaves its session held."""
    _live.add(t)
    if _exit_hooks:
        return
    _exit_hooks.append(os.getpid())
    atexit.register(lambda: [x.goodbye() for x in list(_live)])
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _exit_on_term)


def _exit_on_term(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a second SIGTERM kills at once, as before
    if os.getpid() != _exit_hooks[0]:             # a forked child (a data loader's worker): killed as before
        os.kill(os.getpid(), signum)
        return
    for x in list(_live):
        x.goodbye()
    raise SystemExit(128 + signum)
