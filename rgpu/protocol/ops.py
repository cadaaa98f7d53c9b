"""The ops route's messages, as both ends speak them (no torch import here).

Every message is a msgpack list whose first item is a ``Msg``. Tensors travel as
descriptors; nothing is pickled. Both ends import it from here
(``rgpu.device_backend`` and ``rgpu.server``'s ops route), so neither imports the
other; it stays free of torch so that importing it is cheap anywhere. The C++
parts read the same numbers and tags from ``rgpu_protocol.h`` (``header.py``).

Values inside ``args``/``kwargs``: None, bool, int, float, str and lists stay as
they are; everything else is a one-key dict, the key naming its kind (``TAG``).
"""
from __future__ import annotations

from enum import IntEnum


class Msg(IntEnum):
    # payload after the kind; "events" is the client's allocator log (EVENT below)
    DEFINE = 1    # [op_index, "name.overload", schema string]                post
    OP = 2        # [events, op_index, args, kwargs, outs]                   post
    CALL = 3      # [events, op_index, args, kwargs, first id, id count]     request -> [result, ...]
    UPLOAD = 4    # [events, tensor] + one buffer (contiguous bytes)          post
    DOWNLOAD = 5  # [events, tensor]                                          request -> one buffer
    #               or [events, tensor, byte offset] + the client's (shared) memory, filled in place -> None
    EVENTS = 6    # [events]                                                  post
    SEED = 7      # [device, seed]                                            post
    SYNC = 8      # []                                                        request -> None
    MEMORY = 9    # [device]                                                  request -> [allocated, max allocated]
    PROFILE = 10  # ["start"(, "trace")] post / ["stop", top N] request -> text (+ a gzipped Chrome trace):
    #               a cProfile of this session's executor, or torch.profiler's timeline of its CPU and GPU
    GRAPH = 11    # [graph id, options, graph] (server/ops/graphs.py: the graph's wire form)  post
    RUN = 12      # [events, graph id, inputs, outs]: one call of a shipped graph        post
    GRAPH_FREE = 13  # [graph id]                                                       post
    GRAPH_INFO = 14  # [graph id]                              request -> {"backend", "error", "runs"}
    UPLOAD_PART = 15  # [events, tensor, byte offset] + one buffer (a piece of a big upload)  post
    UPLOAD_INFO = 16  # []              request -> {"pieces": {path: count}, "registered_bytes", "slots_pinned"}
    GET_RNG_STATE = 17  # [device]                              request -> [state bytes]: the device's generators
    SET_RNG_STATE = 18  # [device, state bytes]                 post
    PEER_RECV = 19  # [events, tensor, ticket bytes]: in stream order, take one peer transfer's bytes into it  post
    PEER_SEND = 20  # [events, tensor, ticket, host, port, TLS pin or None]: in stream order, push its bytes there  post
    GROUP_STORE = 21  # [] request -> [host, port]: a rendezvous store (TCPStore) this server opens for a servers' group
    GROUP_JOIN = 22  # [group, host, port, rank, size, backend, device, timeout s, [server per rank]] request -> None:
    #                  this session joins the servers' process group (gloo or nccl) through that store
    COLLECTIVE = 23  # [events, group, name, reduce op, root, [tensor...], [tensor...]]: in stream order  post
    GROUP_LEAVE = 24  # [group]                                   post


class Event(IntEnum):
    """The client allocator's log, flattened into one int list: frees and storage growth."""
    FREE = 0  # id
    COPY = 1  # dst_id, dst_nbytes, device, src_id, count: a storage grew; copy the old bytes over


EVENT_FIELDS = {Event.FREE: 1, Event.COPY: 5}

# One-key dicts carry what msgpack has no type for. Tensor descriptor:
# [storage id, storage nbytes, dtype code, sizes, strides, storage offset, device index]
TAG = {
    "t": "tensor on the rgpu device (descriptor above)",
    "j": "tensor with math bits: [descriptor, conj, neg]; a conj()/_neg_view() view of the descriptor's tensor",
    "s": "CPU scalar tensor: [dtype code, value]",
    "d": "dtype code",
    "v": "device: [type, index]; type 'rgpu' is the server's own device",
    "l": "layout name",
    "m": "memory format name",
    "c": "complex number: [real, imag]",
    "g": "generator: [seed, offset], the op's stream (None: the session's generator for the device)",
}

# c10::ScalarType codes, stable across torch releases (new types are appended);
# a test checks them against the installed torch.
DTYPES = (
    "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
    "complex32", "complex64", "complex128", "bool", "qint8", "quint8", "qint32", "bfloat16",
    "quint4x2", "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "uint16", "uint32", "uint64",
)

LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")
MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")

# How many ids a CALL reserves for outputs whose number the server decides
# (ops returning a list of tensors get many; the server refuses to go past them).
CALL_RESERVED_IDS = 64
CALL_RESERVED_IDS_FOR_LISTS = 4096
