"""cuBLAS beside the real driver: each forwarded call is the same function of NVIDIA's libcublas.so.13, via ctypes.

It runs on the session's thread with its context current (the executor's). A client handle maps to
one real ``cublasHandle_t``; each call carries the client's stream, workspace, math mode and pointer
mode, applied to the real handle only when they changed (``cublasSetStream_v2`` resets the real
workspace to the library's pool, as the client's record does). Host scalars arrive by value and are
passed from a buffer of ours in host pointer mode; device scalars, matrices and vectors are the
server's addresses and pass through. The prototypes are cublas_api.h's (CUDA 13), written out here.

Where the server's C part is built (``real_batch``), the handles and their state live in its table
(``cublas_records.c``, ``self.fast``): the executor's C walker runs queued GEMMs there without Python,
and the calls that come here apply their state through it, so the state has one owner either way.
Without it (no compiler, ``RGPU_NATIVE=off``) ``Handle`` keeps it here.
"""
from __future__ import annotations

import ctypes
import struct
from ctypes import POINTER, c_int, c_longlong, c_size_t, c_uint64, c_void_p

from rgpu.protocol.lib_cublas import DEFAULT_WORKSPACE, INVALID_VALUE, NOT_INITIALIZED, NOT_SUPPORTED, STATE, STATUS

from . import LibError
from .loading import LibraryMissing, load

# bytes of a dot product's result by cudaDataType_t (R_32F, R_64F, R_16F, R_16BF, C_32F, C_64F, C_16F, C_16BF)
RESULT_WIDTH = {0: 4, 1: 8, 2: 2, 14: 2, 4: 8, 5: 16, 6: 4, 15: 4}

STATE_FIELDS = struct.Struct("<" + "".join(code for _, code in STATE))
# the functions the C table calls, in its order (cublas_records.c's enum)
FAST_FUNCTIONS = ("cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasSetMathMode", "cublasSetPointerMode_v2",
                  "cublasSgemm_v2", "cublasDgemm_v2", "cublasGemmEx", "cublasSgemmStridedBatched",
                  "cublasDgemmStridedBatched", "cublasGemmStridedBatchedEx")
NOT_HERE = -2          # the C table's answer for a handle it does not hold

H, I, LL, P = c_void_p, c_int, c_longlong, c_void_p
_GEMM = [H, I, I, I, I, I]                                    # handle, transa, transb, m, n, k
PROTOTYPES = {
    "cublasCreate_v2": [POINTER(c_void_p)],
    "cublasDestroy_v2": [H],
    "cublasGetVersion_v2": [H, POINTER(c_int)],
    "cublasSetStream_v2": [H, P],
    "cublasSetWorkspace_v2": [H, P, c_size_t],
    "cublasSetMathMode": [H, I],
    "cublasSetPointerMode_v2": [H, I],
    # alpha, A, lda, B, ldb, beta, C, ldc
    "cublasSgemm_v2": [*_GEMM, P, P, I, P, I, P, P, I],
    "cublasDgemm_v2": [*_GEMM, P, P, I, P, I, P, P, I],
    # alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType, algo
    "cublasGemmEx": [*_GEMM, P, P, I, I, P, I, I, P, P, I, I, I, I],
    # alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc
    "cublasSgemmEx": [*_GEMM, P, P, I, I, P, I, I, P, P, I, I],
    # alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC, batchCount
    "cublasSgemmStridedBatched": [*_GEMM, P, P, I, LL, P, I, LL, P, P, I, LL, I],
    "cublasDgemmStridedBatched": [*_GEMM, P, P, I, LL, P, I, LL, P, P, I, LL, I],
    # alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount,
    # computeType, algo
    "cublasGemmStridedBatchedEx": [*_GEMM, P, P, I, I, LL, P, I, I, LL, P, P, I, I, LL, I, I, I],
    # alpha, Aarray, Atype, lda, Barray, Btype, ldb, beta, Carray, Ctype, ldc, batchCount, computeType, algo
    "cublasGemmBatchedEx": [*_GEMM, P, P, I, I, P, I, I, P, P, I, I, I, I, I],
    # handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy
    "cublasSgemv_v2": [H, I, I, I, P, P, I, P, I, P, P, I],
    "cublasDgemv_v2": [H, I, I, I, P, P, I, P, I, P, P, I],
    # handle, n, x, incx, y, incy, result
    "cublasSdot_v2": [H, I, P, I, P, I, P],
    "cublasDdot_v2": [H, I, P, I, P, I, P],
    # handle, n, x, xType, incx, y, yType, incy, result, resultType, executionType
    "cublasDotEx": [H, I, P, I, I, P, I, I, P, I, I],
}


def _gemm_args(types=False, strided=False, tail=(), ex=()) -> tuple[str, ...]:
    """A GEMM's fields in its prototype's order, after the handle (the payload's names)."""
    t = (lambda x: (x,)) if types else (lambda x: ())
    s = (lambda x: (x,)) if strided else (lambda x: ())
    return ("transa", "transb", "m", "n", "k", "alpha", "A", *t("atype"), "lda", *s("stride_a"), "B", *t("btype"),
            "ldb", *s("stride_b"), "beta", "C", *t("ctype"), "ldc", *s("stride_c"), *tail, *ex)


_EX = ("compute_type", "algo")
GEMM_ARGS = {   # made once: a call's arguments are then one pass over its fields
    "cublasSgemm_v2": _gemm_args(), "cublasDgemm_v2": _gemm_args(), "cublasSgemmEx": _gemm_args(types=True),
    "cublasGemmEx": _gemm_args(types=True, ex=_EX),
    "cublasSgemmStridedBatched": _gemm_args(strided=True, tail=("batch",)),
    "cublasDgemmStridedBatched": _gemm_args(strided=True, tail=("batch",)),
    "cublasGemmStridedBatchedEx": _gemm_args(types=True, strided=True, tail=("batch",), ex=_EX),
    "cublasGemmBatchedEx": _gemm_args(types=True, tail=("batch",), ex=_EX),
}


class Handle:
    """A client handle's real handle and the state last applied to it (a new handle's own state)."""

    def __init__(self, client: int, real: int):
        self.client, self.real = client, real
        self.stream, self.workspace, self.math_mode, self.pointer_mode = 0, (0, DEFAULT_WORKSPACE), 0, 0


class Library:
    def __init__(self, driver, owner):
        self.driver = driver
        self.handles: dict[int, Handle] = {}     # without the C table: client handle -> its real one and state
        self._lib = None
        self._missing: str | None = None
        self.version = 0
        self.c = self.fast = None                # with it: the C library and this session's table (a pointer)
        self._out = (c_uint64 * 2)()

    # ---- the contract --------------------------------------------------------------------------
    def status_name(self, status: int) -> str:
        return STATUS.get(status, "CUBLAS_STATUS_UNKNOWN")

    def handle_for_lt(self, client_handle: int) -> int | None:
        """The real cublasHandle_t (an int) for a client cuBLAS handle (torch passes it to cuBLASLt), or None."""
        if self.fast:
            return self.c.rgpu_cublas_real(self.fast, client_handle, 0) or None
        h = self.handles.get(client_handle)
        return h.real if h else None

    def records_table(self) -> int | None:
        """The C table the executor's walker runs queued GEMMs through (a pointer), or None."""
        return self.fast

    def close(self) -> None:
        reals = [h.real for h in self.handles.values()]
        if self.fast:
            while real := self.c.rgpu_cublas_nth(self.fast, len(reals)):
                reals.append(real)
            self.c.rgpu_cublas_free(self.fast)
            self.fast = None
        for real in reals:
            self.fn("cublasDestroy_v2")(c_void_p(real))
        self.handles.clear()

    # ---- the library ---------------------------------------------------------------------------
    def fn(self, name: str):
        if self._lib is None:
            if self._missing:
                raise LibError(NOT_INITIALIZED, self._missing)
            try:
                lib = load("libcublas.so.13")
            except LibraryMissing as exc:
                self._missing = str(exc)
                raise LibError(NOT_INITIALIZED, self._missing) from None
            for fname, args in PROTOTYPES.items():
                f = getattr(lib, fname)
                f.argtypes, f.restype = args, c_int
            self._lib = lib
            self._table(lib)
        return getattr(self._lib, name)

    def _table(self, lib) -> None:
        """The C table over ``lib``'s functions, resolved once, where the server's C part is built."""
        from ..real_batch import library
        c = library()
        if c is None:
            return
        self.c, self.fast = c, c.rgpu_cublas_new()
        for slot, fname in enumerate(FAST_FUNCTIONS):
            c.rgpu_cublas_bind(self.fast, slot, ctypes.cast(getattr(lib, fname), c_void_p))

    def _call(self, name: str, *args) -> int:
        return int(self.fn(name)(*args))

    # ---- handles -------------------------------------------------------------------------------
    def cublasCreate_v2(self, handle, stream, tail, client_version):
        if self.handle_for_lt(handle) is not None:
            raise LibError(INVALID_VALUE, f"cuBLAS handle {handle:#x} exists already")
        real = c_void_p()
        status = self._call("cublasCreate_v2", ctypes.byref(real))
        if status:
            return status
        version = c_int()
        self._call("cublasGetVersion_v2", real, ctypes.byref(version))
        if version.value // 10000 != client_version // 10000:
            self._call("cublasDestroy_v2", real)
            raise LibError(NOT_INITIALIZED, f"the client's cuBLAS is {client_version}, the server's "
                                            f"{version.value}: their major versions differ")
        if self.fast:
            self.c.rgpu_cublas_add(self.fast, handle, real.value)
        else:
            self.handles[handle] = Handle(handle, real.value)
        self.version = version.value
        return 0, struct.pack("<i", version.value)

    def cublasDestroy_v2(self, handle, stream, tail):
        h = self.handles.pop(handle, None)
        real = h.real if h else self.fast and self.c.rgpu_cublas_real(self.fast, handle, 1)
        if not real:
            raise LibError(NOT_INITIALIZED, f"cublasDestroy_v2: {handle:#x} is not a cuBLAS handle of this session")
        return self._call("cublasDestroy_v2", c_void_p(real))

    def _use(self, name: str, handle: int, stream, f: dict) -> tuple[int, int]:
        """The real handle and its pointer mode, brought to the state the client's record carries."""
        if self.fast:                            # the C table owns the state: it applies what changed
            state = STATE_FIELDS.pack(*(f.pop(k) for k, _ in STATE))
            status = self.c.rgpu_cublas_use(self.fast, handle, stream or 0, state, len(state), self._out)
            if status == NOT_HERE:
                raise LibError(NOT_INITIALIZED, f"{name}: {handle:#x} is not a cuBLAS handle of this session")
            if status:
                why = self.c.rgpu_cublas_error(self.fast).decode()
                raise LibError(status, f"{name}: {why}: {self.status_name(status)} ({status})")
            return self._out[0], self._out[1]
        h = self.handles.get(handle)
        if h is None:
            raise LibError(NOT_INITIALIZED, f"{name}: {handle:#x} is not a cuBLAS handle of this session")
        workspace, size, math_mode, pointer_mode = (f.pop(k) for k, _ in STATE)
        real, stream = c_void_p(h.real), stream or 0

        def apply(setter, *args):
            status = self._call(setter, real, *args)
            if status:
                raise LibError(status, f"{name}: {setter} failed: {self.status_name(status)} ({status})")

        if stream != h.stream:
            apply("cublasSetStream_v2", c_void_p(stream))
            h.stream, h.workspace = stream, (0, DEFAULT_WORKSPACE)
        if (workspace, size) != h.workspace:
            if size == DEFAULT_WORKSPACE:         # back to the library's pool: what cublasSetStream_v2 does
                apply("cublasSetStream_v2", c_void_p(stream))
            else:
                apply("cublasSetWorkspace_v2", c_void_p(workspace), c_size_t(size))
            h.workspace = (workspace, size)
        if math_mode != h.math_mode:
            apply("cublasSetMathMode", c_int(math_mode))
            h.math_mode = math_mode
        if pointer_mode != h.pointer_mode:
            apply("cublasSetPointerMode_v2", c_int(pointer_mode))
            h.pointer_mode = pointer_mode
        return h.real, h.pointer_mode

    # ---- the computing calls: the client's arguments, in the prototype's order ---------------------
    def _scalars(self, pointer_mode: int, f: dict):
        """alpha and beta as the real call takes them: our copies (host mode) or the device addresses."""
        if pointer_mode == 1:
            return (c_void_p(int.from_bytes(f["alpha"][:8], "little")),
                    c_void_p(int.from_bytes(f["beta"][:8], "little")))
        return ctypes.create_string_buffer(bytes(f["alpha"]), 16), ctypes.create_string_buffer(bytes(f["beta"]), 16)

    def _gemm(self, name, handle, stream, f):
        real, mode = self._use(name, handle, stream, f)
        f["alpha"], f["beta"] = self._scalars(mode, f)
        return self._call(name, real, *[f[k] for k in GEMM_ARGS[name]])

    def cublasSgemm_v2(self, handle, stream, tail, **f):
        return self._gemm("cublasSgemm_v2", handle, stream, f)

    def cublasDgemm_v2(self, handle, stream, tail, **f):
        return self._gemm("cublasDgemm_v2", handle, stream, f)

    def cublasSgemmEx(self, handle, stream, tail, **f):
        return self._gemm("cublasSgemmEx", handle, stream, f)

    def cublasGemmEx(self, handle, stream, tail, **f):
        return self._gemm("cublasGemmEx", handle, stream, f)

    def cublasSgemmStridedBatched(self, handle, stream, tail, **f):
        return self._gemm("cublasSgemmStridedBatched", handle, stream, f)

    def cublasDgemmStridedBatched(self, handle, stream, tail, **f):
        return self._gemm("cublasDgemmStridedBatched", handle, stream, f)

    def cublasGemmStridedBatchedEx(self, handle, stream, tail, **f):
        return self._gemm("cublasGemmStridedBatchedEx", handle, stream, f)

    def cublasGemmBatchedEx(self, handle, stream, tail, **f):    # A, B, C: device arrays of pointers
        return self._gemm("cublasGemmBatchedEx", handle, stream, f)

    def _gemv(self, name, handle, stream, f):
        real, mode = self._use(name, handle, stream, f)
        alpha, beta = self._scalars(mode, f)
        return self._call(name, c_void_p(real), f["trans"], f["m"], f["n"], alpha, c_void_p(f["A"]), f["lda"],
                          c_void_p(f["x"]), f["incx"], beta, c_void_p(f["y"]), f["incy"])

    def cublasSgemv_v2(self, handle, stream, tail, **f):
        return self._gemv("cublasSgemv_v2", handle, stream, f)

    def cublasDgemv_v2(self, handle, stream, tail, **f):
        return self._gemv("cublasDgemv_v2", handle, stream, f)

    def _dot(self, name, handle, stream, f, width, types=None):
        """Into device memory (device pointer mode) the client's address; into host memory ours, answered."""
        real, mode = self._use(name, handle, stream, f)
        host = ctypes.create_string_buffer(16) if mode == 0 else None
        result = host if host is not None else c_void_p(f["result"])
        if types:
            args = (f["n"], c_void_p(f["x"]), f["xtype"], f["incx"], c_void_p(f["y"]), f["ytype"], f["incy"],
                    result, f["result_type"], f["exec_type"])
        else:
            args = (f["n"], c_void_p(f["x"]), f["incx"], c_void_p(f["y"]), f["incy"], result)
        status = self._call(name, c_void_p(real), *args)
        if host is None or status:
            return status
        return 0, host.raw[:width]          # host pointer mode: the call returned once the result was there

    def cublasSdot_v2(self, handle, stream, tail, **f):
        return self._dot("cublasSdot_v2", handle, stream, f, 4)

    def cublasDdot_v2(self, handle, stream, tail, **f):
        return self._dot("cublasDdot_v2", handle, stream, f, 8)

    def cublasDotEx(self, handle, stream, tail, **f):
        width = RESULT_WIDTH.get(f["result_type"])
        if width is None:
            raise LibError(NOT_SUPPORTED, f"cublasDotEx: result type {f['result_type']} is not forwarded")
        return self._dot("cublasDotEx", handle, stream, f, width, types=True)
