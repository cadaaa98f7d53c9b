"""The client's replay log: the frames a resumable session sent, kept until the server acknowledges them.

``resume.py``'s ``ResumingTransport`` adds every send and, after a drop, writes again what the server had
not applied. Kept by reference (no per-frame copy, one entry a send), acknowledged cumulatively.
"""
from __future__ import annotations

import struct
import threading
from collections import deque
from typing import Sequence

from .wire import MsgKind

_BYE, _POST = MsgKind.BYE, MsgKind.POST
_FIELDS = struct.Struct("<6xH4xQ12xI")   # a frame header's kind, seq and nbufs, the rest skipped (wire.HEADER)


class ReplayLog:
    """Sent frames kept until acknowledged, one entry per send: (its last seq, its parts, their bytes), oldest
    first; ``gap`` the newest seq let go unacknowledged because the log was over its bound.

    A send's parts are kept by reference (the frame prefixes are the connection's own bytes, a post's
    small buffers its own copies); only a buffer the caller may change once the send returns (a request's,
    a post's larger than ``owned``) is copied. Acknowledgements are cumulative: an entry goes once the
    server has applied its last frame, and a replay splits the first entry it needs (rare) by its headers.
    """

    def __init__(self, bound: int, owned: int = -1):
        self.bound, self.frames, self.nbytes, self.gap = bound, deque(), 0, 0
        self.owned = owned    # a post's buffers up to this many bytes are the connection's own copies
        self.lock = threading.Lock()

    def add(self, parts: Sequence) -> bool:
        """Keep the frames in ``parts`` (a reference, copied where the caller's memory is named); True when
        one is a BYE. A frame over the bound by itself is never kept: a drop before the server acknowledges
        it ends the session."""
        bye, i, n, owned, unpack = False, 0, len(parts), self.owned, _FIELDS.unpack_from
        kept, size, seq = parts, 0, 0
        while i < n:
            prefix = parts[i]
            kind, seq, nbufs = unpack(prefix)
            i += 1
            size += len(prefix)
            if not nbufs:
                if kind == _BYE:
                    bye = True
                continue
            frame = len(prefix)
            for j, b in enumerate(parts[i:i + nbufs], i):   # (a slice: a malformed header names too many)
                m = b.nbytes if type(b) is memoryview else len(b)
                frame += m
                # the caller's memory: copied, unless the frame is over the bound already (never kept: a
                # 1 GiB upload's copy cost as long as its send)
                if type(b) is not bytes and (kind != _POST or m > owned) and frame <= self.bound:
                    if kept is parts:
                        kept = list(parts)
                    kept[j] = bytes(b)
            i += nbufs
            size += frame - len(prefix)
            if frame > self.bound:            # never kept: the rest of this send is kept without it
                return self._add_without(kept, bye)
        if not n:
            return False
        with self.lock:
            self.frames.append((seq, kept, size))
            self.nbytes += size
        return bye

    def _add_without(self, parts: Sequence, bye: bool) -> bool:
        """``add`` of a send holding a frame over the bound: the others kept, one entry each (through ``add``,
        so the caller's memory in frames after the big one is copied too)."""
        for seq, frame, size in _frames(parts):
            if size > self.bound:
                self.gap = max(self.gap, seq)
                continue
            bye = self.add(frame) or bye
        return bye

    def over(self) -> bool:
        return self.nbytes > self.bound

    def trim(self, ack: int) -> None:
        """Forget the sends the server has acknowledged whole (their last seq up to ``ack``)."""
        with self.lock:
            frames = self.frames
            while frames and frames[0][0] <= ack:
                self.nbytes -= frames.popleft()[2]

    def shed(self) -> None:
        """Over the bound: the oldest frames go (a drop before the server acknowledges them ends the session)."""
        with self.lock:
            while self.frames and self.nbytes > self.bound:
                seq, _, size = self.frames.popleft()
                self.nbytes -= size
                self.gap = max(self.gap, seq)

    def after(self, applied: int) -> list:
        """Every kept frame's parts past ``applied``, in order."""
        self.trim(applied)
        with self.lock:
            out = []
            for i, (_, parts, _) in enumerate(self.frames):
                if i == 0:                    # the one send the server may have applied in part
                    for seq, frame, _ in _frames(parts):
                        if seq > applied:
                            out.extend(frame)
                else:
                    out.extend(parts)
            return out


def _frames(parts: Sequence):
    """Each frame of a send: (seq, its parts, its bytes)."""
    i, n = 0, len(parts)
    while i < n:
        _, seq, nbufs = _FIELDS.unpack_from(parts[i])
        frame = parts[i:i + 1 + nbufs]
        yield seq, frame, sum([b.nbytes if type(b) is memoryview else len(b) for b in frame])
        i += 1 + nbufs
