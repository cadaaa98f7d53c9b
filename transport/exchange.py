"""A connection's exchange state, one owner: what its lone call touches, in one object.

``Exchange`` holds the sequence, the reader's token (``reading``; ``waiters``, the threads waiting for
the reader to hand them their answer), the seq of the write in progress, why the connection died, a
failed post's kept error and the stats counters. The connection's write queue and reply router both
work on it (``connection.py``). Over shm with its C path the same face is a C object
(``shm_lone.c``'s ``LoneCall``), which is also the lone call itself, so that C and Python share one
copy of this state and neither reads the other's private fields; this class is the same state for
every other transport (and the reference).
"""
from __future__ import annotations

import itertools
from collections.abc import MutableMapping

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
