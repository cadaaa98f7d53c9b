"""The client's replay log: the frames a resumable session sent, kept until the server acknowledges them.

``resume.py``'s ``ResumingTransport`` adds every send and, after a drop, writes again what the server had
not applied. Kept by reference (no per-frame copy, one entry a send), acknowledged cumulatively. One
owner: the writer (the transport's write lock held), which adds, forgets what the readers saw
acknowledged, sheds and replays; so no lock of its own, and a lone call's round trip pays for one
header unpacked and its small request copied, nothing more.
"""
from __future__ import annotations

import struct
from collections import deque
from typing import Sequence

from .wire import Held, MsgKind

_BYE, _POST = MsgKind.BYE, MsgKind.POST
_FIELDS = struct.Struct("<6xH4xQ12xI")   # a frame header's kind, seq and nbufs, the rest skipped (wire.HEADER)


class ReplayLog:
    """Sent frames kept until acknowledged, one entry per send: (its last seq, its parts, their bytes), oldest
    first; ``gap`` the newest seq let go unacknowledged because the log was over its bound.

    A send's parts are kept by reference (the frame prefixes are the connection's own bytes, a post's
    small buffers its own copies); only a buffer the caller may change once the send returns (a request's,
    a post's larger than ``owned``) is copied, unless it is ``wire.Held`` (its owner waits for the
    acknowledgement: a big upload's pieces, ``device_backend/transfers.py``). Acknowledgements are
    cumulative: an entry goes once the server has applied its last frame, and a replay splits the first
    entry it needs (rare) by its headers.
    """

    def __init__(self, bound: int, owned: int = -1):
        self.bound, self.frames, self.gap = bound, deque(), 0
        self.owned = owned    # a post's buffers up to this many bytes are the connection's own copies
        self.added, self.dropped = 0, 0   # bytes kept = added - dropped

    @property
    def nbytes(self) -> int:
        return self.added - self.dropped

    def add(self, parts: Sequence) -> bool:
        """Keep the frames in ``parts`` (a reference, copied where the caller's memory is named); True when
        one is a BYE. A frame over the bound by itself is never kept: a drop before the server acknowledges
        it ends the session."""
        return self.keep(parts, 0)

    def keep(self, parts: Sequence, acked: int) -> bool:
        """``trim(acked)`` then ``add(parts)``, in one call: every send's own path (a lone call's request,
        a post written alone), so in as few steps as it takes."""
        frames = self.frames
        if acked:
            while frames and frames[0][0] <= acked:
                self.dropped += frames.popleft()[2]
        n = len(parts)
        if not n:
            return False
        prefix = parts[0]
        kind, seq, nbufs = _FIELDS.unpack_from(prefix)
        if n != nbufs + 1:
            return self._add_frames(parts)
        # one frame (a lone call, a post written alone)
        size, kept = len(prefix), parts
        if nbufs == 1:
            b = parts[1]
            if type(b) is bytes:
                size += len(b)
            else:
                m = b.nbytes if type(b) is memoryview else len(b)
                size += m
                if (size <= self.bound and (kind != _POST or m > self.owned)    # (a view's tobytes(): bytes(view)
                        and not (type(b) is memoryview and type(b.obj) is Held)):   # costs four times as much)
                    kept = (prefix, b.tobytes() if type(b) is memoryview else bytes(b))
        elif nbufs:
            return self._add_frames(parts)
        if size > self.bound:                 # never kept (a 1 GiB upload's copy cost as long as its send)
            if seq > self.gap:
                self.gap = seq
            return False
        frames.append((seq, kept, size))
        self.added += size
        return kind == _BYE

    def _add_frames(self, parts: Sequence) -> bool:
        """``add`` of a send of several frames (a batch of posts), or of one frame of several buffers."""
        bye, i, n, owned, bound, unpack = False, 0, len(parts), self.owned, self.bound, _FIELDS.unpack_from
        kept, size, seq = parts, 0, 0
        while i < n:
            prefix = parts[i]
            kind, seq, nbufs = unpack(prefix)
            i += 1
            frame = len(prefix)
            if not nbufs:
                size += frame
                if kind == _BYE:
                    bye = True
                continue
            copy = kind != _POST
            end = i + nbufs
            if end > n:                           # (a malformed header names too many)
                end = n
            while i < end:
                b = parts[i]
                if type(b) is bytes:
                    frame += len(b)
                else:
                    m = b.nbytes if type(b) is memoryview else len(b)
                    frame += m
                    # the caller's memory: copied, unless the frame is over the bound already (never kept:
                    # a 1 GiB upload's copy cost as long as its send)
                    if (copy or m > owned) and frame <= bound and not (type(b) is memoryview
                                                                       and type(b.obj) is Held):
                        if kept is parts:
                            kept = list(parts)
                        kept[i] = b.tobytes() if type(b) is memoryview else bytes(b)
                i += 1
            size += frame
            if frame > bound:                     # never kept: the rest of this send is kept without it
                return self._add_without(kept, bye)
        self.frames.append((seq, kept, size))
        self.added += size
        return bye

    def _add_without(self, parts: Sequence, bye: bool) -> bool:
        """``add`` of a send holding a frame over the bound: the others kept, one entry each (copied where
        ``add`` copies, so the caller's memory in frames after the big one is copied too)."""
        for seq, frame, size in _frames(parts):
            if size > self.bound:
                self.gap = max(self.gap, seq)
                continue
            bye = self._add_frames(frame) or bye
        return bye

    def over(self) -> bool:
        return self.nbytes > self.bound

    def trim(self, ack: int) -> None:
        """Forget the sends the server has acknowledged whole (their last seq up to ``ack``)."""
        frames = self.frames
        while frames and frames[0][0] <= ack:
            self.dropped += frames.popleft()[2]

    def shed(self) -> None:
        """Over the bound: the oldest frames go (a drop before the server acknowledges them ends the session)."""
        while self.frames and self.nbytes > self.bound:
            seq, _, size = self.frames.popleft()
            self.dropped += size
            self.gap = max(self.gap, seq)

    def after(self, applied: int) -> list:
        """Every kept frame's parts past ``applied``, in order."""
        self.trim(applied)
        out = []
        for i, (_, parts, _) in enumerate(self.frames):
            if i == 0:                        # the one send the server may have applied in part
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
