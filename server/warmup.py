"""Authenticated connections waiting for a warm worker, told so every few seconds (WAIT), never timed out.

A spare worker imports what it preloads (torch: seconds) and, on a fresh host, builds its native
parts once (the server's op path: half a minute or more) before it can take a session. It says
it is warm with one message on its control socket (``ready_message``: what it runs ops on); only
a warm worker is handed a connection, so that message is always read before the acceptor closes its
end (a Unix socket closed with unread data resets the worker's end, and its session with it).
Until one is, the acceptor keeps each authenticated connection here and sends it a WAIT frame
every ``WAIT_EVERY_S``: the client prints one line and keeps waiting, where its handshake timeout
(10 s) would otherwise have ended a first connection to a fresh server.

    room.add(admitted)         a connection the gate admitted
    room.leaving(warm)         those that may go to a worker now: one per warm worker, oldest first
                               (a TLS one waits unannounced: the acceptor cannot write into its TLS stream)
    room.nudge(message)        a WAIT to each one due, a refusal to any that waited past WAIT_LIMIT_S

Standard library, msgpack and ``rgpu.transport`` only.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
import msgpack

from rgpu.errors import RgpuError
from rgpu.transport import handshake
from rgpu.transport.tcp import TcpTransport
from rgpu.transport.wire import MsgKind

log = logging.getLogger("rgpu.server")

WAIT_EVERY_S = 2.0     # well inside a client's handshake timeout (RGPU_CONNECT_TIMEOUT, 10 s)
WAIT_LIMIT_S = 900.0   # a worker that has not warmed up in 15 minutes is not going to
READY = b"R"           # a worker's control message: READY + msgpack {"device": what ops run on}


def ready_message(device: str | None) -> bytes:
    return READY + msgpack.packb({"device": device})


def read_ready(data: bytes) -> dict | None:
    """A worker's control message as a dict, or None when it is not one."""
    if not data.startswith(READY):
        return None
    try:
        got = msgpack.unpackb(data[len(READY):], raw=False)
    except Exception:   # (a malformed message only costs its device line)
        return {}
    return got if isinstance(got, dict) else {}


@dataclass(eq=False)
class Waiting:
    admitted: object          # server.gate.Admitted
    since: float
    last_wait: float = 0.0


class WaitingRoom:
    def __init__(self):
        self.waiting: list[Waiting] = []

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def add(self, admitted) -> None:
        self.waiting.append(Waiting(admitted, time.monotonic()))

    def leaving(self, warm: int) -> list:
        """The connections to hand to a worker now, oldest first: as many as there are ``warm`` workers."""
        out, self.waiting = self.waiting[:warm], self.waiting[warm:]
        return [w.admitted for w in out]

    def nudge(self, message: str) -> None:
        now = time.monotonic()
        for w in list(self.waiting):
            waited = now - w.since
            t = TcpTransport(w.admitted.sock)
            if waited > WAIT_LIMIT_S:
                handshake.refuse(t, "busy", f"no worker of this server warmed up within {WAIT_LIMIT_S:g} s; "
                                 "see its log")
                self._drop(w, "no worker warmed up in time")
            elif now - w.last_wait >= WAIT_EVERY_S and w.admitted.hello is not None:   # (TLS: not ours to write)
                w.last_wait = now
                try:
                    meta = {"message": message, "waited_s": round(waited, 1), "every_s": WAIT_EVERY_S}
                    t.send(t.frame_parts(MsgKind.WAIT, 0, 0, meta, []))
                except RgpuError as exc:     # the client gave up: nothing to hand over
                    self._drop(w, str(exc))

    def _drop(self, w: Waiting, why: str) -> None:
        log.info("a connection from %s left while waiting for a worker: %s", w.admitted.peer, why)
        self.waiting.remove(w)
        w.admitted.sock.close()

    def close(self) -> None:
        for w in self.waiting:
            w.admitted.sock.close()
        self.waiting = []
