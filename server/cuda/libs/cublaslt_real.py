"""cuBLASLt beside the real driver: the heuristic and the matmul run by NVIDIA's libcublasLt.so.13, via ctypes.

It runs on the session's thread with its context current (the executor's). The client's descriptors
arrive serialized (``rgpu.protocol.lib_cublaslt``); real ones are made from them once and kept by content
(a descriptor's device addresses zeroed in the key and set when they differ from the last set), and a
call's whole serialized state maps to its real descriptors once parsed, so steady state creates and
parses nothing. The handle is torch's cuBLAS handle (``cublas_real.Library.handle_for_lt``: cuBLASLt takes a
``cublasHandle_t`` as its own, as torch does natively) or one ``cublasLtCreate`` made here. Host scalars
arrive by value and are passed from a buffer of ours (cuBLASLt reads them during the call); device
scalars and matrices are the server's addresses and pass through. The prototypes are cublasLt.h's
(CUDA 13), written out here.

Where cuBLAS's C table exists (``cublas_records.c``), a matmul runs in C (``cublaslt_records.c``, ``self.fast``):
each state parsed here is handed to it once, and the executor's C walker then runs queued matmuls of that state
on a cuBLAS handle without coming here; the addresses last set on each real descriptor live there, so the calls
that still come here (a new state, a cublasLtCreate handle, the heuristic) set them through it too.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_int32, c_size_t, c_uint64, c_int64, c_void_p

from rgpu.protocol import lib_cublaslt as P
from rgpu.protocol.cuda_libs import BY_NAME

from . import LibError
from .loading import LibraryMissing, load

H = V = c_void_p
PROTOTYPES = {
    "cublasLtCreate": [POINTER(c_void_p)],
    "cublasLtDestroy": [H],
    "cublasLtMatmulDescCreate": [POINTER(c_void_p), c_int, c_int],              # computeType, scaleType
    "cublasLtMatmulDescDestroy": [V],
    "cublasLtMatmulDescSetAttribute": [V, c_int, V, c_size_t],
    "cublasLtMatrixLayoutCreate": [POINTER(c_void_p), c_int, c_uint64, c_uint64, c_int64],   # type, rows, cols, ld
    "cublasLtMatrixLayoutDestroy": [V],
    "cublasLtMatrixLayoutSetAttribute": [V, c_int, V, c_size_t],
    "cublasLtMatmulPreferenceCreate": [POINTER(c_void_p)],
    "cublasLtMatmulPreferenceDestroy": [V],
    "cublasLtMatmulPreferenceSetAttribute": [V, c_int, V, c_size_t],
    # handle, desc, Adesc, Bdesc, Cdesc, Ddesc, preference, requestedAlgoCount, results, returnAlgoCount
    "cublasLtMatmulAlgoGetHeuristic": [H, V, V, V, V, V, V, c_int, V, POINTER(c_int)],
    # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace, workspaceSize, stream
    "cublasLtMatmul": [H, V, V, V, V, V, V, V, V, V, V, V, V, V, c_size_t, V],
}
KINDS = {  # kind -> (create, destroy, set attribute, the attributes create takes)
    P.KIND_DESC: ("cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy", "cublasLtMatmulDescSetAttribute",
                  (P.DESC_COMPUTE_TYPE, P.DESC_SCALE_TYPE)),
    P.KIND_LAYOUT: ("cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutDestroy", "cublasLtMatrixLayoutSetAttribute",
                    (P.LAYOUT_TYPE, P.LAYOUT_ROWS, P.LAYOUT_COLS, P.LAYOUT_LD)),
    P.KIND_PREF: ("cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy",
                  "cublasLtMatmulPreferenceSetAttribute", ()),
}
MAX_KEPT = 4096                 # real descriptors kept per kind; past it the oldest go (they are host objects)
MATMUL_STATE = (P.KIND_DESC,) + (P.KIND_LAYOUT,) * 4
MAX_REQUESTED = 1024
ALLOC_FAILED = 3                # CUBLAS_STATUS_ALLOC_FAILED
NOT_HERE = -2                   # the C table's answer for a state or handle it does not know
MATMUL = BY_NAME["cublasLtMatmul"].format      # the record's fixed fields, repacked for the C table


class Library:
    def __init__(self, driver, owner):
        self.driver = driver
        self.owner = owner
        self.handles: dict[int, int] = {}                      # client handle -> real, from cublasLtCreate
        self.kept: dict[int, dict[bytes, int]] = {k: {} for k in KINDS}   # kind -> content -> real descriptor
        self.resolved: dict[bytes, tuple] = {}     # a call's serialized state -> its real descriptors (_resolve)
        self.pointers: dict[int, tuple] = {}       # real matmul descriptor -> the device addresses last set on it
        self._scalars = ctypes.create_string_buffer(32)
        self._algo = ctypes.create_string_buffer(P.ALGO)
        self._matmul = None                        # cublasLtMatmul, bound at the library's load
        self.c = self.fast = self._cublas = None   # with cuBLAS's C table: the C library, ours, cuBLAS's
        self._lib = None
        self._missing: str | None = None

    # ---- the contract --------------------------------------------------------------------------
    def status_name(self, status: int) -> str:
        return P.STATUS.get(status, "CUBLAS_STATUS_UNKNOWN")

    def live(self) -> int:
        """Real descriptors and handles this session holds."""
        return sum(len(k) for k in self.kept.values()) + len(self.handles)

    def close(self) -> None:
        if self._lib is None:
            return
        if self.fast:
            cublas, table = self._cublas
            if cublas.fast == table:             # still open: its walker must not reach ours once freed
                self.c.rgpu_cublas_set_lt(table, None)
            self.c.rgpu_cublaslt_free(self.fast)
            self.c = self.fast = self._cublas = None
        for kind, kept in self.kept.items():
            destroy = self.fn(KINDS[kind][1])
            for real in kept.values():
                destroy(c_void_p(real))
            kept.clear()
        self.resolved.clear()
        self.pointers.clear()
        for real in self.handles.values():
            self.fn("cublasLtDestroy")(c_void_p(real))
        self.handles.clear()

    # ---- the library ---------------------------------------------------------------------------
    def fn(self, name: str):
        if self._lib is None:
            if self._missing:
                raise LibError(P.NOT_INITIALIZED, self._missing)
            try:
                lib = load("libcublasLt.so.13")
            except LibraryMissing as exc:
                self._missing = str(exc)
                raise LibError(P.NOT_INITIALIZED, self._missing) from None
            for fname, args in PROTOTYPES.items():
                f = getattr(lib, fname)
                f.argtypes, f.restype = args, c_int
            self._lib, self._matmul = lib, lib.cublasLtMatmul
            self._table(lib)
        return getattr(self._lib, name)

    def _table(self, lib) -> None:
        """Our C table, hung on cuBLAS's (the walker's entry), where the server's C part is built."""
        from ..real_batch import library
        c = library()
        if c is None:
            return
        cublas = self.owner.library("cublas")
        try:
            cublas.fn("cublasCreate_v2")            # loaded: its C table made (torch's handles are its)
        except LibError:
            return
        table = cublas.records_table()
        if not table:
            return
        self.c, self._cublas = c, (cublas, table)
        self.fast = c.rgpu_cublaslt_new(ctypes.cast(lib.cublasLtMatmul, c_void_p),
                                        ctypes.cast(lib.cublasLtMatmulDescSetAttribute, c_void_p))
        c.rgpu_cublas_set_lt(table, self.fast)

    def _check(self, status: int, what: str) -> None:
        if status:
            raise LibError(status, f"{what}: {self.status_name(status)} ({status})")

    # ---- handles -------------------------------------------------------------------------------
    def _handle(self, handle: int) -> int:
        """The real handle for a client one: torch's cuBLAS handle, or one cublasLtCreate made."""
        real = self.handles.get(handle)
        if real is not None:
            return real
        try:
            cublas = self.owner.library("cublas")
        except Exception:      # noqa: BLE001  (no cuBLAS implementation here yet: our own handles only)
            cublas = None
        find = getattr(cublas, "handle_for_lt", None)
        real = find(handle) if find is not None else None
        if real is None:
            raise LibError(P.NOT_INITIALIZED, f"handle {handle:#x} is not a cuBLAS or cuBLASLt handle of this session")
        return int(real)

    def cublasLtCreate(self, handle, stream, tail, client_version):
        if handle in self.handles:
            raise LibError(P.INVALID_VALUE, f"cuBLASLt handle {handle:#x} exists already")
        real = c_void_p()
        self._check(int(self.fn("cublasLtCreate")(ctypes.byref(real))), "cublasLtCreate")
        self.handles[handle] = real.value
        return 0

    def cublasLtDestroy(self, handle, stream, tail):
        real = self.handles.pop(handle, None)
        if real is None:
            raise LibError(P.NOT_INITIALIZED, f"handle {handle:#x} was not created by cublasLtCreate")
        return int(self.fn("cublasLtDestroy")(c_void_p(real)))

    # ---- descriptors ---------------------------------------------------------------------------
    def _real(self, obj: P.Obj | None) -> int | None:
        """The real descriptor for ``obj``, made once per content (its device addresses: ``_pointers``)."""
        if obj is None:
            return None
        create, destroy, set_attr, args = KINDS[obj.kind]
        kept = self.kept[obj.kind]
        key = obj.key[1]
        real = kept.get(key)
        if real is None:
            real = self._make(obj, create, set_attr, args)
            if len(kept) >= MAX_KEPT:
                gone = kept.pop(next(iter(kept)))
                self.fn(destroy)(c_void_p(gone))
                self.pointers.pop(gone, None)
                self._forget()                   # its states may name the one destroyed
            kept[key] = real
        return real

    def _forget(self) -> None:
        self.resolved.clear()
        if self.fast:
            self.c.rgpu_cublaslt_forget(self.fast)

    def _pointers(self, real: int, pointers: tuple) -> None:
        """A matmul descriptor's device addresses (bias, scales, ...), set when they differ from the last set."""
        if pointers and self.fast:               # the C table holds what was last set
            attrs, values = pointers
            self._check(int(self.c.rgpu_cublaslt_pointers(self.fast, real, len(attrs), attrs, values)),
                        "cublasLtMatmulDescSetAttribute (a device address)")
        elif pointers and self.pointers.get(real) != pointers:
            for attr, value in pointers:
                self._set(KINDS[P.KIND_DESC][2], real, attr, value)
            self.pointers[real] = pointers

    def _resolve(self, tail, kinds: tuple[int, ...]) -> tuple:
        """``(real descriptors, the desc's pointer mode)`` for a serialized state, parsed once per content."""
        key = bytes(tail)
        got = self.resolved.get(key)
        if got is None:
            objs = self._state(tail, kinds)
            desc = objs[0]
            pointers = tuple((a, desc.attrs[a]) for a in sorted(P.DESC_POINTERS & desc.attrs.keys()))
            got = (tuple(self._real(o) for o in objs), desc.int(P.DESC_POINTER_MODE), pointers)
            if len(self.resolved) >= MAX_KEPT:
                self._forget()
            if self.fast:
                got = got[:2] + (self._to_c(key, got, kinds),)
            self.resolved[key] = got
        reals, mode, pointers = got
        self._pointers(reals[0], pointers)
        return reals, mode

    def _to_c(self, key: bytes, got: tuple, kinds: tuple[int, ...]):
        """A state handed to the C table (a matmul's), and its addresses as the C table takes them."""
        reals, mode, pointers = got
        bad = [a for a, v in pointers if len(v) != 8]
        if bad:
            raise LibError(P.INVALID_VALUE, f"matmul descriptor attributes {bad}: a device address is 8 bytes")
        attrs = (c_int32 * len(pointers))(*(a for a, _ in pointers))
        values = (c_uint64 * len(pointers))(*(int.from_bytes(v, "little") for _, v in pointers))
        if kinds == MATMUL_STATE:   # only a matmul's state goes to the C table (a heuristic query has six objects)
            real = (c_uint64 * len(reals))(*(r or 0 for r in reals))   # a null descriptor: 0, as Python passes it
            if self.c.rgpu_cublaslt_state(self.fast, key, len(key), real, mode, len(pointers), attrs, values):
                raise LibError(ALLOC_FAILED, "the C table refused a matmul state (no memory)")
        return (attrs, values) if pointers else ()

    def _make(self, obj: P.Obj, create: str, set_attr: str, args: tuple[int, ...]) -> int:
        missing = [a for a in args if a not in obj.attrs]
        if missing:
            raise LibError(P.INVALID_VALUE, f"a descriptor without its creation attributes {missing}")
        real = c_void_p()
        if obj.kind == P.KIND_DESC:
            values = (obj.int(P.DESC_COMPUTE_TYPE), obj.int(P.DESC_SCALE_TYPE))
        elif obj.kind == P.KIND_LAYOUT:
            values = (obj.int(P.LAYOUT_TYPE, signed=False), obj.int(P.LAYOUT_ROWS, signed=False),
                      obj.int(P.LAYOUT_COLS, signed=False), obj.int(P.LAYOUT_LD))
        else:
            values = ()
        self._check(int(self.fn(create)(ctypes.byref(real), *values)), create)
        try:
            for attr, value in obj.attrs.items():
                if attr not in args and not (obj.kind == P.KIND_DESC and attr in P.DESC_POINTERS):   # _pointers
                    self._set(set_attr, real.value, attr, value)
        except LibError:
            self.fn(KINDS[obj.kind][1])(real)
            raise
        return real.value

    def _set(self, set_attr: str, real: int, attr: int, value: bytes) -> None:
        buf = ctypes.create_string_buffer(value, len(value))
        self._check(int(self.fn(set_attr)(c_void_p(real), attr, buf, len(value))), f"{set_attr} ({attr})")

    def _state(self, tail, kinds: tuple[int, ...]) -> list:
        try:
            return P.parse_as(tail, kinds)
        except P.StateError as exc:
            raise LibError(P.INVALID_VALUE, str(exc)) from None

    # ---- the calls -----------------------------------------------------------------------------
    def cublasLtMatmulAlgoGetHeuristic(self, handle, stream, tail, requested):
        real = self._handle(handle)
        if not 0 < requested <= MAX_REQUESTED:
            raise LibError(P.INVALID_VALUE, f"{requested} algos requested")
        (desc, a, b, c, d, pref), _ = self._resolve(tail, (P.KIND_DESC,) + (P.KIND_LAYOUT,) * 4 + (P.KIND_PREF,))
        results = ctypes.create_string_buffer(P.RESULT * requested)
        count = c_int(0)
        status = int(self.fn("cublasLtMatmulAlgoGetHeuristic")(
            c_void_p(real), c_void_p(desc), c_void_p(a), c_void_p(b), c_void_p(c), c_void_p(d), c_void_p(pref),
            requested, results, ctypes.byref(count)))
        if status:
            return status
        return 0, results.raw[:P.RESULT * max(0, min(count.value, requested))]

    def cublasLtMatmul(self, handle, stream, tail, alpha, beta, alpha_ptr, beta_ptr, a, b, c, d, workspace,
                       workspace_size, algo, has_algo):
        real = self._handle(handle)
        (desc, ad, bd, cd, dd), mode = self._resolve(tail, MATMUL_STATE)
        if self.fast:                                # the C table knows this state now: it runs it
            payload = MATMUL.pack(alpha, beta, alpha_ptr, beta_ptr, a, b, c, d, workspace, workspace_size, algo,
                                  has_algo) + bytes(tail)
            status = self.c.rgpu_cublaslt_record(self.fast, self._cublas[1], handle, stream or 0, payload,
                                                 len(payload))
            if status != NOT_HERE:                   # NOT_HERE: a cublasLtCreate handle, run below
                return status
        # cublasLtPointerMode_t: 0 both host; 1, 2 both device; 3 alpha device, beta unread; 4 alpha device, beta host
        scalars = self._scalars                      # ours, read by the library during the call
        ctypes.memmove(scalars, alpha, 16)
        ctypes.memmove(ctypes.addressof(scalars) + 16, beta, 16)
        alpha_arg = ctypes.addressof(scalars) if mode == 0 else alpha_ptr
        beta_arg = ctypes.addressof(scalars) + 16 if mode in (0, 4) else beta_ptr
        if has_algo:
            ctypes.memmove(self._algo, algo, P.ALGO)
        matmul = self._matmul or self.fn("cublasLtMatmul")
        return matmul(real, desc, alpha_arg or None, a or None, ad, b or None, bd, beta_arg or None, c or None, cd,
                      d or None, dd, self._algo if has_algo else None, workspace or None, workspace_size, stream or None)
