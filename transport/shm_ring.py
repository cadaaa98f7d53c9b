"""The shm transport's shared layout: the control segment, the records, and what both directions use.

    control segment (a sealed memfd the server makes)
      line 0              magic, version, ring size, slots, nonce (read back by the client as proof)
      lines 1..8          per direction d: tail (producer), head (consumer), consumer asleep,
                          producer waiting for space; each on its own cache line
      4 KiB + d * 4 KiB   slot table of direction d (1 while the receiver holds a frame's heap buffers)
      16 KiB + d * RING   ring of direction d: one record per frame
    heap segments         sealed memfds each sender makes for its big buffers, passed over the Unix socket

A record is ``REC`` (length, kind, slot, descriptors, blob length, blob in heap),
then ``DESC`` per buffer placed in a segment, then the blob (the frame's prefix
and its small buffers) unless that lives in the heap too.
"""
from __future__ import annotations

import array
import os
import socket
import struct
import threading

from rgpu.protocol.wire import SHM_KIND_FRAME, SHM_KIND_WRAP, SHM_NO_SLOT, SHM_RECORD

from .wire import MsgKind

CTL_MAGIC = b"RGPUSHM1"
CTL_VERSION = 1
RING_BYTES = 1 << 20
RECORD_MAX = RING_BYTES // 4
INLINE_MAX = 16 << 10          # bigger buffers go through the heap and are read in place
MAX_PLACED = (RECORD_MAX - 24) // 16 - 1   # heap places one record can name
SLOTS = 4096
SLOTS_OFF = 4096
RINGS_OFF = 16384
CONTROL_BYTES = RINGS_OFF + 2 * RING_BYTES
NONCE_OFF, NONCE_BYTES = 24, 32
CTL_HEAD = struct.Struct("<8sIII")         # magic, version, ring bytes, slots
REC = SHM_RECORD                           # length, kind, slot, descriptors, blob length, blob in heap
REC_HEAD = struct.Struct("<II")            # length, kind: all a wrap marker has
DESC = struct.Struct("<IIQ")               # buffer index (BLOB: the prefix itself), segment id, offset
CTL_MSG = struct.Struct("<IIQ")            # op, segment id, size: on the Unix socket
OP_SEGMENT, OP_DROP = 1, 2
KIND_FRAME, KIND_WRAP = SHM_KIND_FRAME, SHM_KIND_WRAP   # rgpu.protocol's (shm_fast.c reads rgpu_protocol.h)
NO_SLOT = BLOB = SHM_NO_SLOT
BACKSTOP_S = 0.05
SHARED_CORE_S = 1.0
CORE_CHECK_S = 0.1
MAX_SEGMENT = 16 << 30

_FENCE = threading.Lock()
_KINDS = {int(k): k for k in MsgKind}
KNOWN_KINDS = sum(1 << k for k in _KINDS)      # the same as a bit per kind, for the C calls
_LENGTHS: dict[int, struct.Struct] = {}


def _lengths(n: int) -> struct.Struct:
    st = _LENGTHS.get(n)
    if st is None:
        st = struct.Struct(f"<{n}Q")
        if len(_LENGTHS) < 256:
            _LENGTHS[n] = st
    return st


def _fence() -> None:
    _FENCE.acquire()
    _FENCE.release()


def _word(line: int) -> int:
    return line * 8                      # index of a cache line's first u64


def _words(d: int) -> tuple[int, int, int, int]:
    """(tail, head, asleep, waiting) word indexes of direction d."""
    base = 1 + 4 * d
    return _word(base), _word(base + 1), _word(base + 2), _word(base + 3)


def recv_fds(sock: socket.socket, size: int, maxfds: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """``socket.recv_fds`` with its flags honoured (3.11's drops them)."""
    msg, ancdata, _, _ = sock.recvmsg(size, socket.CMSG_LEN(maxfds * 4), flags)
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def _drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except (BlockingIOError, InterruptedError):
        pass


class Ends:
    """A shm transport's ring ends, one owner: the tail it writes (published to the peer by ``_publish``),
    the head it reads, whether it was closed, until when (``perf_counter``) the peer shares our core.
    With the C path the transport holds shm_native.c's ``Ends`` instead, the same face, which the lone
    call (``shm_lone.c``) moves in C; this is the Python path's."""

    __slots__ = ("tail", "head", "closed", "shared_until")

    def __init__(self, tail: int, head: int):
        self.tail, self.head, self.closed, self.shared_until = tail, head, False, 0.0
