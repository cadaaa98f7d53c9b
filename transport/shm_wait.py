"""shm's waiting: until a record comes in (the receiver) or ring space and heap slots come back (the writer).

A waiting side polls (keeping its core for ``busy_s``, yielding it after) until
``spin_s``, then sleeps on an eventfd, having set its word (asleep, waiting) for
the peer to see; the Unix socket that carried the descriptors also says when
the peer is gone (POLLHUP). When data comes just as a yield returns late and the
peer last ran on our CPU (/proc, looked at most every ``CORE_CHECK_S``), the peer
shares our core: for ``SHARED_CORE_S`` a wait yields from the start.
"""
from __future__ import annotations

import os
import select
import time
from typing import Callable

from rgpu.errors import ConnectionLost

from .shm_memory import PeerSegments
from .shm_ring import BACKSTOP_S, CORE_CHECK_S, SHARED_CORE_S, _drain, _fence


def _spin(q, tail: int, head: int, busy: float, end: float, yield_core: bool) -> int:
    """Poll the tail until ``end``, keeping the core until ``busy`` and yielding it after.

    0: nothing came; 1: data came; 2: it came as a yield returned late (something ran in our
    place: most likely the peer, on our core, so keeping the core only delays it).
    """
    clock = time.perf_counter
    while (now := clock()) < end:
        if q[tail] != head:
            return 1
        if now > busy and yield_core:
            os.sched_yield()
            if clock() - now > 3e-6 and q[tail] != head:
                return 2
    return 1 if q[tail] != head else 0


def _cpu_of(path: str) -> int:
    with open(path, "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[36])   # field 39 of stat: the CPU it last ran on


def _same_core(peer: int) -> bool:
    """Whether the peer process last ran on the CPU this thread runs on (a cheap look, taken rarely)."""
    if peer <= 0 or peer == os.getpid():
        return False
    try:
        return _cpu_of("/proc/thread-self/stat") == _cpu_of(f"/proc/{peer}/stat")
    except (OSError, ValueError, IndexError):
        return False


class Waits:
    """One end's waits, and the state they own: how long they spin (``busy_s``, ``spin_s``, ``spin_yield``),
    whether the server's C loop just spun for nothing (the next data wait sleeps at once), when the peer
    was last looked for on our core, the two polls (data eventfd + socket, space eventfd + socket).

    Given when made: the control words ``q`` and the indexes of this end's words (the incoming tail and
    our asleep flag; the outgoing head and our waiting flag), the ``Ends`` (its head and closed flag are
    read, its ``shared_until`` set), the two eventfds waited on, the Unix socket, the peer's pid, the
    ``PeerSegments`` that reads what the socket says (``service()``, ``gone``), and the C path's wait and
    ring (``c_wait``, ``c_ring``; None: the Python spin).
    """

    # A waiting side polls busy_s keeping its core, then yields it until spin_s, then sleeps on its
    # eventfd; sharing a core with the peer it yields from the start for SHARED_CORE_S. Measured on
    # the shared 2-core machine, docs/perf/transport.md. spin_s: RGPU_SHM_SPIN_US, else
    # base.spin_seconds's default (20 ms on a machine of 8 cores or more, spin_s below elsewhere).
    busy_s = 20e-6
    spin_s = 100e-6
    spin_yield = True

    def __init__(self, q: memoryview, tail_in: int, asleep_in: int, head_out: int, waiting_out: int, ends,
                 data_in: int, space_out: int, sock, peer_pid: int, peer: PeerSegments, spin_s: float,
                 c_wait=None, c_ring=None):
        self._q, self._tail_in, self._asleep_in = q, tail_in, asleep_in
        self._head_out, self._waiting_out = head_out, waiting_out
        self._ends = ends
        self._data_in, self._space_out = data_in, space_out
        self._peer, self._peer_pid = peer, peer_pid
        self.spin_s = spin_s
        self.c_wait, self._c_ring = c_wait, c_ring    # the C spin, without the GIL (tests may wrap c_wait)
        self._core_checked = 0.0
        self._spun = False                     # serve() found nothing within its spin: the next wait sleeps
        self._poll_data = select.poll()
        self._poll_data.register(data_in, select.POLLIN)
        self._poll_data.register(sock, select.POLLIN)
        self._poll_space = select.poll()
        self._poll_space.register(space_out, select.POLLIN)
        self._poll_space.register(sock, select.POLLRDHUP)

    def busy_for(self, now: float) -> float:
        """How long a wait keeps its core before yielding it: none while the peer shares our core."""
        return self.busy_s if now >= self._ends.shared_until else 0.0

    def spun(self, for_nothing: bool) -> None:
        """The server's C loop waited its spin just now: for nothing, the next data wait sleeps at once."""
        self._spun = for_nothing

    def data(self, deadline: float | None = None) -> bool:
        """Until a record is in (True), or ``deadline`` (``time.monotonic``) passes (False); ``ConnectionLost``
        once closed or the peer is gone. What the socket says meanwhile goes to the ``PeerSegments``."""
        q, tail, head = self._q, self._tail_in, self._ends.head
        if q[tail] != head:
            return True
        now = time.perf_counter()
        end = now + (0.0 if self._spun else self.spin_s)   # the C loop of serve() spun just now: sleep
        self._spun = False
        if deadline is not None:
            end = min(end, now + deadline - time.monotonic())
        busy_s = self.busy_s if now >= self._ends.shared_until else 0.0
        if self.c_wait is not None:   # the same spin in C, without the GIL
            got = self.c_wait(self._c_ring, head, busy_s, end - now, self.spin_yield)
        else:
            got = _spin(q, tail, head, now + busy_s, end, self.spin_yield)
        if got == 2 and now > self._core_checked + CORE_CHECK_S:
            self._core_checked = now
            if _same_core(self._peer_pid):
                self._ends.shared_until = now + SHARED_CORE_S    # keeping the core only delays the peer
        if got:
            return True
        return self._sleep_for_data(deadline)

    def _sleep_for_data(self, deadline: float | None) -> bool:
        q, tail, head = self._q, self._tail_in, self._ends.head
        while True:
            if self._ends.closed:
                raise ConnectionLost("connection closed")
            q[self._asleep_in] = 1
            _fence()
            if q[tail] != head:
                q[self._asleep_in] = 0
                return True
            if self._peer.gone:
                q[self._asleep_in] = 0
                raise ConnectionLost("the peer closed the shm connection")
            wait = BACKSTOP_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    q[self._asleep_in] = 0
                    return False
            events = self._poll_data.poll(wait * 1000)
            q[self._asleep_in] = 0
            for fd, _ev in events:
                if fd == self._data_in:
                    _drain(fd)
                elif not self._ends.closed:
                    self._peer.service()
            if q[tail] != head:
                return True

    def space(self, ready: Callable[[], bool], on_block: Callable[[], "bool | None"] | None) -> None:
        """Until ``ready()``: the receiver frees ring space or heap slots (it wakes us when we say we wait).

        Meanwhile ``on_block`` (a connection's) may read replies the peer is blocked on.
        """
        q = self._q
        now = time.perf_counter()
        busy, end = now + self.busy_s, now + self.spin_s
        while (now := time.perf_counter()) < end:
            if ready():
                return
            if now > busy and self.spin_yield:
                os.sched_yield()
        while True:
            if self._ends.closed:
                raise ConnectionLost("connection closed")
            wait = BACKSTOP_S
            if on_block is not None:
                want = on_block()
                if want is not None:
                    if ready():
                        return
                    wait = 0.002 if want else 0.01     # a reply may be due: look again soon
            q[self._waiting_out] = 1
            _fence()
            if ready():
                q[self._waiting_out] = 0
                return
            events = self._poll_space.poll(wait * 1000)
            q[self._waiting_out] = 0
            for fd, ev in events:
                if fd == self._space_out:
                    _drain(fd)
                elif ev & (select.POLLHUP | select.POLLRDHUP | select.POLLERR):
                    raise ConnectionLost("connection closed" if self._ends.closed else "the peer went away (shm)")
            if ready():
                return
