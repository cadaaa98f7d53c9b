"""A session's orderly end when ``rgpu serve`` stops (SIGTERM): the op running finishes, then a BYE says why.

The acceptor closes its port and sends each session's worker SIGTERM. The worker's handler only
marks the stop while an op runs; while the session waits for its next frame (``idle``), it raises
``Stopping`` out of the wait. Either way the frame loop ends between frames, tells the client
(``REASON``, which the client raises as ``SessionLost``) and releases what the session held. The
acceptor waits ``GRACE_S`` for its workers before it kills them.
"""
from __future__ import annotations

import signal
import threading

GRACE_S = 10.0
REASON = ("the server is shutting down (rgpu serve was stopped with SIGTERM); this session's state is gone: "
          "reconnect once it is back")


class Stopping(BaseException):
    """Raised out of a session's wait for its next frame when the server stops (never out of an op)."""


class StopSignal:
    """Whether SIGTERM came, and whether the session waits for a frame (then it ends at once)."""

    def __init__(self):
        self.requested = False
        self.idle = False

    def install(self) -> "StopSignal":
        """Take SIGTERM, in a worker's main thread (a session served on another thread, in tests, keeps its own)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_term)
        return self

    def _on_term(self, signum, frame) -> None:
        self.requested = True
        if self.idle:
            self.idle = False
            raise Stopping()
