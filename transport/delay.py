"""The delay line behind ``RGPU_SIM_RTT_MS``: a transport wrapper that makes every exchange cost one round trip.

All of the delay sits on the client's sends: a frame leaves ``rtt`` seconds after
``send()`` returned, in order, with no cap on how many bytes are in flight;
replies come back at once. Any exchange (a post followed by a request, a chain
of posts and one wait) then costs what it would with ``rtt / 2`` each way, and
the server sees the same stream in the same order, only later. Why one side:
the client alone can hold frames (no reader thread, no change to the server),
and a zero delay sends on the caller's thread, so benchmarks can switch the
delay on a live connection (``set_rtt``) and compare with no delay at all.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Sequence

from rgpu.errors import ConnectionLost, RgpuError

from .base import Capabilities, Transport

class DelayTransport(Transport):
    """Wraps a connected transport; ``rtt`` (seconds) may change at any time."""

    def __init__(self, inner: Transport, rtt: float = 0.0):
        self.inner, self.rtt = inner, rtt
        self.name = inner.name
        # gathers nothing, writes nothing inline (its line is a thread); whether the session resumes is the inner's
        self.capabilities = Capabilities(resumable=inner.capabilities.resumable)
        self.delayed = 0                      # writes that went through the line (tests)
        self._cv = threading.Condition()      # guards the queue and the state below
        self._queue: deque = deque()          # (due, parts)
        self._send_lock = threading.Lock()    # held while writing: keeps direct and delayed sends in order
        self._thread: threading.Thread | None = None
        self._error: RgpuError | None = None
        self._closing = False

    def frame_parts(self, kind: int, seq: int, ack: int, meta, views, flags: int = 0) -> list:
        if self.rtt > 0:
            # the caller may reuse its buffers once send() returns, long before the frame leaves:
            # the line keeps copies (made here, so any inner transport's parts hold only its own)
            views = [memoryview(bytes(v)) for v in views]
        return self.inner.frame_parts(kind, seq, ack, meta, views, flags)

    def send(self, parts: Sequence) -> None:
        with self._send_lock:  # nothing popped by the line is still being written once we hold this
            with self._cv:
                if self._error is not None:
                    raise self._error
                direct = self.rtt <= 0 and not self._queue
                if not direct:
                    self._queue.append((time.monotonic() + self.rtt, list(parts)))
                    self.delayed += 1
                    if self._thread is None:
                        self._thread = threading.Thread(target=self._line, name="rgpu-delay", daemon=True)
                        self._thread.start()
                    self._cv.notify_all()
            if direct:
                self.inner.send(parts)

    def _line(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                due = self._queue[0][0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self._send_lock:
                with self._cv:
                    now, batch = time.monotonic(), []
                    while self._queue and self._queue[0][0] <= now:
                        batch.extend(self._queue.popleft()[1])
                    self._cv.notify_all()
                if not batch:
                    continue
                try:
                    self.inner.send(batch)
                except RgpuError as exc:
                    with self._cv:
                        self._error = exc
                        self._queue.clear()
                        self._cv.notify_all()
                    return

    def recv_frame(self, limits, pool, into=None):
        return self.inner.recv_frame(limits, pool, into)

    def readable(self, timeout: float) -> bool:
        return self.inner.readable(timeout)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every delayed frame has been written."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ConnectionLost("the delay line did not drain in time")
                self._cv.wait(left if left is not None else 0.5)
        with self._send_lock:
            pass

    def close(self) -> None:
        try:
            self.drain(timeout=self.rtt + 5.0)  # an orderly close lets the BYE through
        except RgpuError:
            pass
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self.inner.close()

    def abort(self) -> None:
        with self._cv:
            self._closing = True
            self._queue.clear()
            self._cv.notify_all()
        self.inner.abort()


def set_rtt(conn, ms: float) -> None:
    """Give a live connection a simulated round trip of ``ms`` (0: none; the wrapper stays, sending directly)."""
    t = conn.transport
    if not isinstance(t, DelayTransport):
        if ms <= 0:
            return
        conn.flush()
        t = conn.transport = DelayTransport(t)
    t.rtt = ms / 1000.0
