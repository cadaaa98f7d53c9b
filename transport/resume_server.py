"""Sessions that outlive a dropped tcp connection: the server's end (each seq applied once, answers re-sent).

``ResumableEnd`` wraps a worker's ``TcpTransport`` when its session was offered a resume id. When the
connection drops, the read or write that met it waits up to the grace for the acceptor to hand over a
resumed connection (authenticated again, the id checked: ``server/serve.py``), instead of ending:

- a frame whose seq it has had already (the client's replay overlaps) is skipped: each seq is applied
  at most once; ``done`` is the last seq handed to the executor;
- answers (REPLY, ERROR) are kept, copied, the most recent ones up to ``RGPU_REPLAY_BYTES``, until the
  client says it read them (a lone call's request carries the seq of the last answer read in its ``ack``
  field, so a session of calls keeps one answer, not ``ANSWERS_KEPT``); a resumed client says the seq of
  the last answer it read and gets the later ones again, in order;
- the client's kept frames are acknowledged in every reply's ``ack`` and, during a stretch of posts, by
  a REPLY of seq 0 every ``ACK_EVERY`` seqs or ``ACK_BYTES`` (cumulative: no per-frame count).

Past the grace the wait raises ``ConnectionLost`` and the session ends as before: everything freed.
"""
from __future__ import annotations

import hmac
import queue
import socket
import struct
import time
from collections import deque
from typing import Sequence

from rgpu.errors import ConnectionLost, RgpuError

from . import handshake
from .base import Transport
from .tcp import TcpTransport
from .wire import MsgKind

_REPLY, _ERROR, _POST = MsgKind.REPLY, MsgKind.ERROR, MsgKind.POST
_KIND_SEQ = struct.Struct("<6xH4xQ")   # a frame header's kind and seq, the rest skipped (wire.HEADER)
ACK_EVERY = 1024         # frames between two acknowledgements when no answer carries one (the client keeps
                         # references: about 100 bytes a small post) ...
ACK_BYTES = 1 << 20      # ... or bytes of theirs (at most an eighth of the client's replay bound): the first
ANSWERS_KEPT = 1024      # most answers kept for a resumed client, whatever their size


class ResumableEnd(Transport):
    """The worker's side of a resumable session; ``resumed`` is a queue of (socket, details) from the acceptor."""
    name = "tcp"
    serve = None

    def __init__(self, inner: TcpTransport, session_id: str, resume_id: str, grace_s: float, bound: int, settings,
                 client_bound: int | None = None):
        self._inner = inner
        self.session_id, self._id, self.grace_s, self.bound = session_id, resume_id, grace_s, bound
        self.settings = settings
        self.resumed: queue.Queue = queue.Queue()
        self.done = 0                 # the last seq handed on (applied, or failed with an ERROR)
        self.answers: deque = deque() # (seq, parts, nbytes), oldest first
        self.kept = 0
        self.lost_upto = 0            # the newest answer no longer kept
        self.read_upto = 0            # the client's word: it read every answer up to this seq (not kept since)
        self._acked, self._bytes_since_ack = 0, 0   # the seq last acknowledged; bytes read since
        # acknowledged well before the client's log is full (its bound, said in its HELLO)
        self._ack_bytes = max(1, min(ACK_BYTES, (client_bound or bound) // 8))
        self.resumes = 0

    @property
    def spin_s(self) -> float:
        return self._inner.spin_s

    def tune_reads(self, spin_us, use_c: bool = True) -> None:
        self._inner.tune_reads(spin_us, use_c)

    def readable(self, timeout: float) -> bool:
        return self._inner.readable(timeout)

    def recv_frame(self, limits, pool, into=None):
        while True:
            try:
                frame = self._inner.recv_frame(limits, pool, into)
            except ConnectionLost as exc:
                self._await_resume(exc)
                continue
            ack = frame.ack
            if ack > self.read_upto:          # the client read the answers up to it: a resume never asks again
                self.read_upto, answers = ack, self.answers
                while answers and answers[0][0] <= ack:
                    self.kept -= answers.popleft()[2]
            seq = frame.seq
            if seq > self.done:
                self.done = seq
                if frame.kind is _POST:   # (a request is acknowledged by its answer, sent before the next read)
                    for b in frame.buffers:   # acknowledged by seq, cumulatively: no count kept a frame
                        self._bytes_since_ack += b.nbytes
                    if seq - self._acked >= ACK_EVERY or self._bytes_since_ack >= self._ack_bytes:
                        self._ack(seq)
                return frame
            if not seq:
                return frame
            frame.release()               # replayed, and had already: applied once

    def _ack(self, seq: int) -> None:
        self._acked, self._bytes_since_ack = seq, 0
        self.send(self._inner.frame_parts(_REPLY, 0, seq, None, []))

    def send(self, parts: Sequence) -> None:
        kind, seq = _KIND_SEQ.unpack_from(parts[0])
        if seq and (kind == _REPLY or kind == _ERROR):
            # a prefix and one view (most replies) kept here, a call fewer on every reply; the rest by _keep
            if len(parts) == 2 and type(parts[1]) is memoryview and type(parts[0]) is bytes:
                size = len(parts[0]) + parts[1].nbytes
                if size > self.bound:
                    self.lost_upto = seq          # never kept (as in _keep)
                else:
                    self.answers.append((seq, (parts[0], parts[1].tobytes()), size))
                    self.kept += size
                    if self.kept > self.bound or len(self.answers) > ANSWERS_KEPT:
                        self._forget()
            else:
                self._keep(seq, parts)
            self._acked, self._bytes_since_ack = seq, 0   # every answer acknowledges up to it (seqs only grow)
        try:
            self._inner.send(parts)
        except ConnectionLost as exc:
            self._await_resume(exc)           # re-sends the kept answers, this one among them

    def _keep(self, seq: int, parts: Sequence) -> None:
        # sized before the copy: an answer over the bound is never kept (a 1 GiB download's copy cost as
        # long as its send); every reply passes here, so no comprehension (a call) and a view's tobytes()
        # (bytes(view) costs four times as much)
        size, copy = 0, parts
        for p in parts:
            if type(p) is bytes:
                size += len(p)
            else:
                size += p.nbytes if type(p) is memoryview else len(p)
                copy = None
        if size > self.bound:
            self.lost_upto = seq
            return
        if copy is None:
            if len(parts) == 2 and type(parts[0]) is bytes:    # a prefix and one buffer: most replies
                b = parts[1]
                copy = [parts[0], b.tobytes() if type(b) is memoryview else bytes(b)]
            else:
                copy = [p if type(p) is bytes else p.tobytes() if type(p) is memoryview else bytes(p) for p in parts]
        self.answers.append((seq, copy, size))
        self.kept += size
        if self.kept > self.bound or len(self.answers) > ANSWERS_KEPT:
            self._forget()

    def _forget(self) -> None:
        """The oldest answers go, until what is kept is within the bound and the count."""
        answers = self.answers
        while self.kept > self.bound or len(answers) > ANSWERS_KEPT:
            old, _, n = answers.popleft()
            self.kept -= n
            self.lost_upto = old

    def interrupt(self) -> None:
        """A resumed connection arrived: the current one is dead to the client (wake a read blocked on it)."""
        try:
            self._inner.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _await_resume(self, why: ConnectionLost) -> None:
        if self.grace_s <= 0:
            raise why
        self._inner.close()
        deadline = time.monotonic() + self.grace_s
        while True:
            try:
                sock, details = self.resumed.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ConnectionLost(f"the connection dropped ({why}) and the client did not resume the session "
                                     f"within its grace of {self.grace_s:g} s") from None
            while sock is not None and not self.resumed.empty():   # a later try: the client gave up on this one
                sock.close()
                sock, details = self.resumed.get_nowait()
            if sock is None:              # the acceptor is gone: nobody can resume us
                raise why
            t = TcpTransport(sock)
            refusal = self._refusal(details)
            if refusal is not None:
                handshake.refuse(t, "resume", refusal)
                t.close()
                if details.get("resume") == self._id:
                    raise ConnectionLost(refusal)   # our client, and it cannot go on: the session ends
                continue
            try:
                self._welcome(t, details["received"])
            except RgpuError:
                t.close()                 # dropped again at once: wait for the next try
                continue
            self._inner = t
            self.resumes += 1
            return

    def _refusal(self, details: dict) -> str | None:
        """Why the resumed connection cannot go on (a wrong id, answers it missed no longer kept), or None."""
        rid, received = details.get("resume"), details.get("received")
        if not isinstance(rid, str) or not hmac.compare_digest(rid.encode(), self._id.encode()):
            return "no session to resume under that id"
        if not isinstance(received, int) or received < self.lost_upto:
            return (f"the answers after seq {received} were past the replay bound of {self.bound} bytes "
                    "(RGPU_REPLAY_BYTES) and are gone")
        if received < self.read_upto:
            return (f"the client said it had read the answers up to seq {self.read_upto}, and now asks for those "
                    f"after seq {received}: they are no longer kept")
        return None

    def _welcome(self, t: TcpTransport, received: int) -> None:
        t.sock.settimeout(None)
        handshake.welcome(t, self.session_id, [], {}, resumed={"applied": self.done})
        again = [p for seq, parts, _ in self.answers if seq > received for p in parts]
        if again:
            t.send(again)
        t.tune_reads(self.settings.tcp_spin_us, self.settings.shm_c)

    def close(self) -> None:
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


def accept_tls_resume(sock: socket.socket, details: dict, resume: dict, session_id: str, routes: set, settings):
    """A TLS session's resumed connection, raw from the acceptor: the go-ahead, the TLS handshake and the
    token's proof here (``tls.py``); (its TLS socket, what it resumes) or None when it fails, the session's
    live connection untouched (the id alone, seen in plain, cannot take it over)."""
    from . import tls
    from .wire import Limits

    sock.settimeout(max(0.5, float(details.get("deadline_s") or settings.auth_timeout)))
    ssock = None
    try:
        sock.sendall(tls.RESUME_GO)
        ssock = tls.server_context(resume["tls"]["cert"], resume["tls"]["key"]).wrap_socket(sock, server_side=True)
        t = TcpTransport(ssock)
        hello = handshake.server_handshake(t, resume["token"].encode(), Limits.from_settings(settings), routes)
        if hello.session != session_id:
            handshake.refuse(t, "resume", "no session to resume under that id")
            raise ConnectionLost("a resume for another session")
    except (RgpuError, OSError):
        (ssock or sock).close()
        return None
    return ssock, {"resume": hello.options.get("resume"), "received": hello.options.get("received")}
