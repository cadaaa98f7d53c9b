"""cuBLASLt's forwarded calls (``cuda_intercept/lib_cublaslt.c`` on the client, ``server/cuda/libs/cublaslt_*.py``).

Descriptors, layouts and preferences never leave the client: they are attribute sets there, and travel
serialized (``STATE`` below) inside the heuristic query (answered, cached on the client by content) and
the matmul record (queued). The server materializes real descriptors from them, cached by content.

A serialized state is a run of objects, each ``<u32 kind><u32 nbytes>`` then ``nbytes`` of attributes
``<u32 attr><u32 size><size bytes>`` in increasing attr order (verbatim as the program set them; a
descriptor's creation arguments are its attributes too). Kind 0 is a NULL object. The heuristic's tail
is desc, A, B, C, D, preference; the matmul's is desc, A, B, C, D.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .lib_call import LibCall

IDS = (0x200, 0x300)

CALLS: tuple[LibCall, ...] = (
    # a handle the program creates itself (torch passes its cuBLAS handle instead); the server makes a real one
    LibCall(0x200, "cublasLtCreate", (("client_version", "Q"),), sync=True),
    LibCall(0x201, "cublasLtDestroy"),
    # output: `requested` cublasLtMatmulHeuristicResult_t at most (RESULT bytes each)
    LibCall(0x202, "cublasLtMatmulAlgoGetHeuristic", (("requested", "i"),), sync=True),
    # alpha/beta: the scale type's bytes when host scalars, else *_ptr a device address (pointer mode)
    LibCall(0x203, "cublasLtMatmul", (
        ("alpha", "16s"), ("beta", "16s"), ("alpha_ptr", "Q"), ("beta_ptr", "Q"),
        ("a", "Q"), ("b", "Q"), ("c", "Q"), ("d", "Q"), ("workspace", "Q"), ("workspace_size", "Q"),
        ("algo", "64s"), ("has_algo", "I"))),
)

KIND_NULL, KIND_DESC, KIND_LAYOUT, KIND_PREF = 0, 1, 2, 3
OBJECT = struct.Struct("<II")
ATTR = struct.Struct("<II")
ALGO = 64                      # sizeof(cublasLtMatmulAlgo_t): uint64_t data[8]
RESULT = 96                    # sizeof(cublasLtMatmulHeuristicResult_t): algo, size_t, status, float, int[4]

# attribute ids (cublasLt.h) the server sides read
DESC_COMPUTE_TYPE, DESC_SCALE_TYPE, DESC_POINTER_MODE, DESC_TRANSA, DESC_TRANSB = 0, 1, 2, 3, 4
DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_BATCH_STRIDE, DESC_BIAS_DATA_TYPE = 7, 8, 10, 26
DESC_POINTERS = frozenset((8, 11, 17, 18, 19, 20, 21, 23, 24, 36))   # device addresses: set per call, never keyed
LAYOUT_TYPE, LAYOUT_ORDER, LAYOUT_ROWS, LAYOUT_COLS, LAYOUT_LD = 0, 1, 2, 3, 4
LAYOUT_BATCH_COUNT, LAYOUT_BATCH_STRIDE = 5, 6


# cublasStatus_t (cublas_api.h), shared with cuBLAS
STATUS = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
          7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
          13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
          16: "CUBLAS_STATUS_LICENSE_ERROR"}
NOT_INITIALIZED, INVALID_VALUE, NOT_SUPPORTED = 1, 7, 15


class StateError(ValueError):
    """A serialized state that does not parse (the server answers CUBLAS_STATUS_INVALID_VALUE)."""


@dataclass
class Obj:
    kind: int
    attrs: dict[int, bytes] = field(default_factory=dict)
    raw: bytes = b""              # the serialized attributes: a cache key

    @property
    def key(self) -> tuple[int, bytes]:
        """What a materialized descriptor is cached by: the content, a descriptor's device addresses zeroed
        (they are set at each call, so every layer's bias shares one descriptor)."""
        if self.kind != KIND_DESC or not DESC_POINTERS & self.attrs.keys():
            return self.kind, self.raw
        return self.kind, b"".join(ATTR.pack(a, len(v)) + (bytes(len(v)) if a in DESC_POINTERS else v)
                                   for a, v in sorted(self.attrs.items()))

    def int(self, attr: int, default: int = 0, signed: bool = True) -> int:
        value = self.attrs.get(attr)
        return default if value is None else int.from_bytes(value, "little", signed=signed)


def parse(tail, count: int) -> list[Obj | None]:
    """``count`` serialized objects from ``tail`` (a NULL object is None); StateError if malformed."""
    data = bytes(tail)
    out, pos = [], 0
    for _ in range(count):
        if pos + OBJECT.size > len(data):
            raise StateError(f"a state of {len(data)} bytes holds fewer than {count} objects")
        kind, n = OBJECT.unpack_from(data, pos)
        pos += OBJECT.size
        if kind not in (KIND_NULL, KIND_DESC, KIND_LAYOUT, KIND_PREF) or pos + n > len(data):
            raise StateError(f"object {len(out)}: kind {kind}, {n} bytes past the state's end or unknown")
        raw, end, attrs = data[pos:pos + n], pos + n, {}
        while pos < end:
            if pos + ATTR.size > end:
                raise StateError(f"object {len(out)}: a truncated attribute")
            attr, size = ATTR.unpack_from(data, pos)
            pos += ATTR.size
            if pos + size > end:
                raise StateError(f"object {len(out)}: attribute {attr} of {size} bytes overruns it")
            attrs[attr] = data[pos:pos + size]
            pos += size
        out.append(None if kind == KIND_NULL else Obj(kind, attrs, raw))
    return out



def parse_as(tail, kinds: tuple[int, ...]) -> list[Obj | None]:
    """The objects of ``tail``, each of the kind given (only a preference may be NULL); StateError if not."""
    objs = parse(tail, len(kinds))
    for i, (obj, kind) in enumerate(zip(objs, kinds)):
        if obj is None and kind != KIND_PREF or obj is not None and obj.kind != kind:
            raise StateError(f"object {i} is not a {('desc', 'layout', 'pref')[kind - 1]}")
    return objs