"""The rgpu frame's constants: magic, version, header layout, message kinds, flags (the codec: ``transport/wire.py``).

Also the shm ring's record kinds (``transport/shm_ring.py`` and ``shm_fast.c`` both
write them). C reads these numbers from ``rgpu_protocol.h``.
"""
from __future__ import annotations

import enum
import struct

MAGIC = b"RGPU"
PROTOCOL_VERSION = 1
# magic, version, kind, flags, seq, ack, meta length, buffer count; then a u64 length per buffer
HEADER = struct.Struct("<4sHHIQQII")
LENGTH = struct.Struct("<Q")


class MsgKind(enum.IntEnum):
    HELLO = 1       # client -> server: {proto, versions, route, session, transports, nonce, options}
    CHALLENGE = 2   # server -> client: {versions, nonce, proof}; proof = HMAC(token, server|cn|sn|session)
    PROOF = 3       # client -> server: {proof}; proof = HMAC(token, client|sn|cn|session)
    WELCOME = 4     # server -> client: {transport, session, info (the route's welcome dict)}
    REFUSED = 5     # either way: {code: "auth"|"version"|"route"|"busy"|"protocol", message}
    WAIT = 6        # server -> client, before WELCOME, every few s: {message, waited_s, every_s}; the server is
                    # warming up (a worker importing torch, a first build): the client keeps waiting
    POST = 10       # call with no reply: route-defined meta + buffers
    REQUEST = 11    # call answered by REPLY or ERROR carrying the same seq
    REPLY = 12      # answer: route-defined meta + buffers; seq = the request's
    ERROR = 13      # {seq, op, type, message}: a request or an earlier post failed
    BYE = 14        # orderly close, no payload
    UPGRADE = 15    # transport negotiation after WELCOME: {transport, ...} (shm, ucx)


class Flags(enum.IntFlag):
    NONE = 0
    LAST_IN_BATCH = 1  # informational: the writer flushed after this frame


KNOWN_FLAGS = int(Flags.LAST_IN_BATCH)

# The shm ring's records: a frame's record (length, kind, slot, descriptors, blob length, blob in heap)
# or a wrap marker (length, kind) that sends the reader back to the ring's start.
SHM_RECORD = struct.Struct("<IIIIII")
SHM_KIND_FRAME, SHM_KIND_WRAP = 1, 2
SHM_NO_SLOT = 0xFFFFFFFF   # a record that holds no reply slot; as a descriptor's buffer index: the blob itself
