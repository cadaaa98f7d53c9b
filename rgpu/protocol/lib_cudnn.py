"""cuDNN's forwarded calls (``cuda_intercept/lib_cudnn.c`` on the client, ``server/cuda/libs/cudnn_*.py``).

Handles and descriptors are minted on the client (the call's ``handle`` is the minted id); the server
maps them, inside attribute payloads too: a ``cudnnBackendSetAttribute`` of ``CUDNN_TYPE_HANDLE`` or
``CUDNN_TYPE_BACKEND_DESCRIPTOR`` carries client ids (8 bytes each) that the server turns into its real
values; ``VOID_PTR`` elements are device addresses and pass through. The handle's stream is kept on the
client (``cudnnSetStream`` answers there) and travels as the call's stream.

Tails:
    SetAttribute      the elements, ``count * WIDTH[type]`` bytes
    GetAttribute      descriptor elements only: the caller's descriptors to fill, ``requested`` client ids
    SetTensorNd       ``nbdims`` int32 dims, then ``nbdims`` int32 strides
    Execute           the plan's by-value tensors' host bytes (``BY_VALUE`` below): per tensor ``PATCH``
                      (uid, nbytes), then nbytes padded to 8; the server puts them where the pointers were

Answers (the reply's buffer):
    GetAttribute      int64 count, then the elements (``min(requested, count) * WIDTH[type]`` bytes); for
                      descriptor elements, one ``DUMP`` per filled descriptor instead (u32 length, the dump)
    Finalize          a ``DUMP`` of the finalized descriptor: what the client answers later Gets from
    size queries      uint64 bytes

A dump is entries of ``ENTRY`` (name, type, count, nbytes) then nbytes of elements; a descriptor-typed
attribute carries its count only (nbytes 0, ``COUNT_ONLY`` set in its type): the caller's descriptors to
fill make its Get a round trip, a count query does not. A plan's dump may hold an rgpu entry, ``BY_VALUE``
(INT64 pairs uid, nbytes): its tensors passed by value (``CUDNN_ATTR_TENSOR_IS_BY_VALUE``, e.g. an
attention scale), whose variant-pack pointer is a host address of the client, so their bytes travel.
"""
from __future__ import annotations

import struct

from .lib_call import LibCall

IDS = (0x300, 0x400)

# cudnnBackendAttributeType_t (cudnn_graph.h) -> bytes per element: handles, pointers and descriptors
# 8, BOOLEAN a C bool (1), CHAR 1, FRACTION two int64, the enums int.
WIDTH = {0: 8, 1: 4, 2: 1, 3: 8, 4: 4, 5: 8, 6: 8, 7: 4, 8: 4, 9: 4, 10: 4, 11: 4, 12: 4, 13: 4, 14: 4, 15: 8,
         16: 4, 17: 4, 18: 4, 19: 4, 20: 4, 21: 4, 22: 4, 23: 4, 24: 1, 25: 4, 26: 16, 27: 4, 28: 4, 29: 4, 30: 4}
TYPE_HANDLE, TYPE_BACKEND_DESCRIPTOR, TYPE_VOID_PTR = 0, 15, 6
ENTRY = struct.Struct("<iiqq")          # attribute name, type (| COUNT_ONLY), element count, bytes that follow
COUNT_ONLY = 1 << 16
BY_VALUE = -1                           # a plan's by-value tensors, in its dump
PATCH = struct.Struct("<qq")            # a by-value tensor's uid and byte count in an Execute's tail

_BN = (("mode", "i"), ("ops", "i"))

CALLS: tuple[LibCall, ...] = (
    # the server creates the real handle: its status says whether cuDNN loaded there
    LibCall(0x300, "cudnnCreate", (("client_version", "q"),), sync=True),
    LibCall(0x301, "cudnnDestroy"),
    LibCall(0x302, "cudnnBackendCreateDescriptor", (("type", "i"),)),
    LibCall(0x303, "cudnnBackendDestroyDescriptor"),
    LibCall(0x304, "cudnnBackendSetAttribute", (("name", "i"), ("type", "i"), ("count", "q"))),
    LibCall(0x305, "cudnnBackendGetAttribute", (("name", "i"), ("type", "i"), ("requested", "q")), sync=True),
    LibCall(0x306, "cudnnBackendInitialize", sync=True),
    # answered: a frontend tries the next engine on NOT_SUPPORTED; the reply carries the readable attributes
    LibCall(0x307, "cudnnBackendFinalize", sync=True),
    # a variant pack's, queued: torch makes one per execution, and nothing tries another on its failure
    LibCall(0x313, "cudnnBackendFinalizeQueued"),
    LibCall(0x308, "cudnnBackendExecute", (("plan", "Q"), ("pack", "Q"))),
    LibCall(0x309, "cudnnCreateTensorDescriptor"),
    LibCall(0x30A, "cudnnSetTensorNdDescriptor", (("dtype", "i"), ("nbdims", "i"))),
    LibCall(0x30B, "cudnnDestroyTensorDescriptor"),
    LibCall(0x30C, "cudnnDeriveBNTensorDescriptor", (("x", "Q"), ("mode", "i"))),
    LibCall(0x30D, "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize",
            _BN + (("x", "Q"), ("z", "Q"), ("y", "Q"), ("bn", "Q"), ("act", "Q")), sync=True),
    LibCall(0x30E, "cudnnGetBatchNormalizationBackwardExWorkspaceSize",
            _BN + (("x", "Q"), ("y", "Q"), ("dy", "Q"), ("dz", "Q"), ("dx", "Q"), ("dbn", "Q"), ("act", "Q")), sync=True),
    LibCall(0x30F, "cudnnGetBatchNormalizationTrainingExReserveSpaceSize", _BN + (("act", "Q"), ("x", "Q")), sync=True),
    # scalars as doubles (the client read them at the width of x's data type; the server narrows them back)
    LibCall(0x310, "cudnnBatchNormalizationForwardTrainingEx", _BN + (
        ("alpha", "d"), ("beta", "d"), ("x", "Q"), ("x_data", "Q"), ("z", "Q"), ("z_data", "Q"), ("y", "Q"),
        ("y_data", "Q"), ("bn", "Q"), ("scale", "Q"), ("bias", "Q"), ("factor", "d"), ("running_mean", "Q"),
        ("running_var", "Q"), ("epsilon", "d"), ("save_mean", "Q"), ("save_inv_var", "Q"), ("act", "Q"),
        ("workspace", "Q"), ("workspace_size", "Q"), ("reserve", "Q"), ("reserve_size", "Q"))),
    LibCall(0x311, "cudnnBatchNormalizationBackwardEx", _BN + (
        ("alpha_data", "d"), ("beta_data", "d"), ("alpha_param", "d"), ("beta_param", "d"), ("x", "Q"),
        ("x_data", "Q"), ("y", "Q"), ("y_data", "Q"), ("dy", "Q"), ("dy_data", "Q"), ("dz", "Q"), ("dz_data", "Q"),
        ("dx", "Q"), ("dx_data", "Q"), ("dbn", "Q"), ("scale", "Q"), ("bias", "Q"), ("dscale", "Q"), ("dbias", "Q"),
        ("epsilon", "d"), ("save_mean", "Q"), ("save_inv_var", "Q"), ("act", "Q"), ("workspace", "Q"),
        ("workspace_size", "Q"), ("reserve", "Q"), ("reserve_size", "Q"))),
    LibCall(0x312, "cudnnBatchNormalizationForwardInference", (
        ("mode", "i"), ("alpha", "d"), ("beta", "d"), ("x", "Q"), ("x_data", "Q"), ("y", "Q"), ("y_data", "Q"),
        ("bn", "Q"), ("scale", "Q"), ("bias", "Q"), ("mean", "Q"), ("var", "Q"), ("epsilon", "d"))),
)


def dump(entries) -> bytes:
    """A descriptor's readable attributes: ``entries`` of (name, type, count, element bytes or None)."""
    out = bytearray()
    for name, type_, count, data in entries:
        if data is None:
            out += ENTRY.pack(name, type_ | COUNT_ONLY, count, 0)
        else:
            out += ENTRY.pack(name, type_, count, len(data)) + bytes(data)
    return bytes(out)


def undump(data) -> list[tuple[int, int, int, bytes | None]]:
    """The entries of a dump (the inverse of ``dump``)."""
    out, pos, data = [], 0, memoryview(data)
    while pos + ENTRY.size <= len(data):
        name, type_, count, n = ENTRY.unpack_from(data, pos)
        pos += ENTRY.size
        out.append((name, type_ & ~COUNT_ONLY, count, None if type_ & COUNT_ONLY else bytes(data[pos:pos + n])))
        pos += n
    return out
