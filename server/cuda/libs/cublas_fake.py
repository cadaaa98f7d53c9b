"""cuBLAS beside the fake driver: the forwarded calls computed with torch on the CPU, over the fake device memory.

Matrices are column-major, read in place through strided views of the fake driver's allocations
(``lda`` and the batch strides become view strides), computed in double precision (complex double for
complex types) and rounded once into C's type. Every call runs as the fake driver's stream work
(``_run``): in order with the copies and kernels, recorded when the stream is being captured. Device
scalars are read when the work runs, as the GPU would. The math mode is kept, not honoured (no
reduced precision here); the workspace is kept and unused.
"""
from __future__ import annotations

import struct

import numpy as np
import torch

from rgpu.protocol.lib_cublas import DEFAULT_WORKSPACE, INVALID_VALUE, NOT_INITIALIZED, NOT_SUPPORTED, STATE, STATUS

from . import LibError

VERSION = 130100                       # what the fake answers as its cuBLAS (13.1.0)
# cudaDataType_t -> torch dtype (library_types.h)
DTYPES = {0: torch.float32, 1: torch.float64, 2: torch.float16, 14: torch.bfloat16, 4: torch.complex64,
          5: torch.complex128, 3: torch.int8, 10: torch.int32}
# cublasComputeType_t -> the real scale type (complex when C is)
SCALES = {64: torch.float16, 65: torch.float16, 68: torch.float32, 69: torch.float32, 74: torch.float32,
          75: torch.float32, 77: torch.float32, 78: torch.float32, 70: torch.float64, 71: torch.float64,
          79: torch.float64, 72: torch.int32, 73: torch.int32,
          # CUDA 10's form, a cudaDataType_t (the complex ones name their real part's width)
          0: torch.float32, 4: torch.float32, 1: torch.float64, 5: torch.float64, 2: torch.float16, 10: torch.int32}
_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}
F32, F64 = torch.float32, torch.float64


class Handle:
    """One client handle: the state the client's setters last gave it, as the real handle would hold."""

    def __init__(self, client: int):
        self.client = client
        self.stream, self.workspace, self.workspace_size = 0, 0, DEFAULT_WORKSPACE
        self.math_mode, self.pointer_mode = 0, 0


class Library:
    def __init__(self, driver, owner):
        self.driver = driver
        self.mem = driver.mem
        self.handles: dict[int, Handle] = {}

    # ---- the contract --------------------------------------------------------------------------
    def status_name(self, status: int) -> str:
        return STATUS.get(status, "CUBLAS_STATUS_UNKNOWN")

    def handle_for_lt(self, client_handle: int) -> Handle | None:
        """The handle object for a client cuBLAS handle (torch passes it to cuBLASLt), or None."""
        return self.handles.get(client_handle)

    def records_table(self) -> None:
        """No C table here: every record comes through ``Libraries.run``."""
        return None

    def close(self) -> None:
        self.handles.clear()

    # ---- handles -------------------------------------------------------------------------------
    def cublasCreate_v2(self, handle, stream, tail, client_version):
        if client_version // 10000 != VERSION // 10000:
            raise LibError(NOT_INITIALIZED, f"the client's cuBLAS is {client_version}, the server's {VERSION}: "
                                            "their major versions differ")
        if handle in self.handles:
            raise LibError(INVALID_VALUE, f"cuBLAS handle {handle:#x} exists already")
        self.handles[handle] = Handle(handle)
        return 0, struct.pack("<i", VERSION)

    def cublasDestroy_v2(self, handle, stream, tail):
        if self.handles.pop(handle, None) is None:
            raise LibError(NOT_INITIALIZED, f"cublasDestroy_v2: {handle:#x} is not a cuBLAS handle of this session")
        return 0

    def _use(self, name: str, handle: int, stream, f: dict) -> Handle:
        h = self.handles.get(handle)
        if h is None:
            raise LibError(NOT_INITIALIZED, f"{name}: {handle:#x} is not a cuBLAS handle of this session")
        h.stream = stream or 0
        h.workspace, h.workspace_size, h.math_mode, h.pointer_mode = (f.pop(k) for k, _ in STATE)
        if h.pointer_mode not in (0, 1):
            raise LibError(INVALID_VALUE, f"{name}: pointer mode {h.pointer_mode}")
        return h

    # ---- reading and writing device memory -----------------------------------------------------
    def _dtype(self, name: str, code: int) -> torch.dtype:
        if code not in DTYPES:
            raise LibError(NOT_SUPPORTED, f"{name}: data type {code} is not computed by the fake cuBLAS")
        return DTYPES[code]

    def _matrices(self, ptr: int, dtype, rows: int, cols: int, ld: int, batch: int = 1, stride: int = 0):
        """``batch`` column-major rows x cols matrices at ptr (leading dimension ld, ``stride`` elements apart)."""
        if not rows or not cols or not batch:
            return torch.zeros((batch, rows, cols), dtype=dtype)
        span = stride * (batch - 1) + ld * (cols - 1) + rows
        flat = torch.frombuffer(self.mem.view(ptr, span * dtype.itemsize), dtype=dtype)
        return flat.as_strided((batch, rows, cols), (stride, 1, ld))

    def _vector(self, ptr: int, dtype, count: int, inc: int):
        if count <= 0:
            return torch.zeros(0, dtype=dtype)
        flat = torch.frombuffer(self.mem.view(ptr, (abs(inc) * (count - 1) + 1) * dtype.itemsize), dtype=dtype)
        v = flat.as_strided((count,), (abs(inc),))
        return v.flip(0) if inc < 0 else v      # BLAS: a negative increment walks from the far end

    def _scalar(self, device: bool, raw: bytes, dtype):
        """A scalar's value: its bytes in host pointer mode, else read from device memory now."""
        if device:
            raw = bytes(self.mem.view(int.from_bytes(raw[:8], "little"), dtype.itemsize))
        value = torch.frombuffer(bytearray(raw[:dtype.itemsize]), dtype=dtype)[0]
        return complex(value) if dtype.is_complex else float(value)

    # ---- GEMM ----------------------------------------------------------------------------------
    def _gemm(self, name, handle, stream, f, types, scale, batched="no"):
        device = self._use(name, handle, stream, f).pointer_mode == 1   # at call time: a graph replays it later
        ta, tb, m, n, k = f["transa"], f["transb"], f["m"], f["n"], f["k"]
        if ta not in (0, 1, 2) or tb not in (0, 1, 2) or min(m, n, k) < 0:
            raise LibError(INVALID_VALUE, f"{name}: transa {ta}, transb {tb}, m {m}, n {n}, k {k}")
        ar, ac = (m, k) if ta == 0 else (k, m)
        br, bc = (k, n) if tb == 0 else (n, k)
        for ld, rows, what in ((f["lda"], ar, "lda"), (f["ldb"], br, "ldb"), (f["ldc"], m, "ldc")):
            if ld < max(1, rows):
                raise LibError(INVALID_VALUE, f"{name}: {what} {ld} is less than {max(1, rows)}")
        at, bt, ct = types
        batch = f.get("batch", 1)
        if batch < 0 or min(f.get("stride_a", 0), f.get("stride_b", 0), f.get("stride_c", 0)) < 0:
            raise LibError(INVALID_VALUE, f"{name}: batch {batch}, strides must not be negative")
        wide = torch.complex128 if ct.is_complex else torch.float64

        def operand(t, trans):
            t = t.to(wide)
            return t.transpose(-1, -2).conj() if trans == 2 else t.transpose(-1, -2) if trans == 1 else t

        def one(a_ptr, b_ptr, c_ptr, count, sa, sb, sc):
            alpha, beta = self._scalar(device, f["alpha"], scale), self._scalar(device, f["beta"], scale)
            a = operand(self._matrices(a_ptr, at, ar, ac, f["lda"], count, sa), ta)
            b = operand(self._matrices(b_ptr, bt, br, bc, f["ldb"], count, sb), tb)
            c = self._matrices(c_ptr, ct, m, n, f["ldc"], count, sc)
            out = alpha * (a @ b)
            if beta != 0:                               # beta 0: C is not read (its NaNs do not count)
                out = out + beta * c.to(wide)
            c.copy_(out.real.round() if not ct.is_floating_point and not ct.is_complex else out)

        def work():
            if batched == "pointers":                   # device arrays of device pointers
                ptrs = [self.mem.array(f[x], batch, np.uint64) if batch else [] for x in ("A", "B", "C")]
                for a_ptr, b_ptr, c_ptr in zip(*ptrs):
                    one(int(a_ptr), int(b_ptr), int(c_ptr), 1, 0, 0, 0)
            else:
                one(f["A"], f["B"], f["C"], batch, f.get("stride_a", 0), f.get("stride_b", 0), f.get("stride_c", 0))

        self.driver._run(stream, work)
        return 0

    def _scale(self, name, compute_type, ctype):
        if compute_type not in SCALES:
            raise LibError(NOT_SUPPORTED, f"{name}: compute type {compute_type} is not computed by the fake cuBLAS")
        s = SCALES[compute_type]
        return _COMPLEX.get(s, s) if ctype.is_complex else s

    def _ex(self, name, handle, stream, f, batched="no"):
        types = tuple(self._dtype(name, f.pop(x)) for x in ("atype", "btype", "ctype"))
        scale = self._scale(name, f.pop("compute_type"), types[2])
        f.pop("algo")
        return self._gemm(name, handle, stream, f, types, scale, batched)

    def cublasSgemm_v2(self, handle, stream, tail, **f):
        return self._gemm("cublasSgemm_v2", handle, stream, f, (F32, F32, F32), F32)

    def cublasDgemm_v2(self, handle, stream, tail, **f):
        return self._gemm("cublasDgemm_v2", handle, stream, f, (F64, F64, F64), F64)

    def cublasSgemmStridedBatched(self, handle, stream, tail, **f):
        return self._gemm("cublasSgemmStridedBatched", handle, stream, f, (F32, F32, F32), F32)

    def cublasDgemmStridedBatched(self, handle, stream, tail, **f):
        return self._gemm("cublasDgemmStridedBatched", handle, stream, f, (F64, F64, F64), F64)

    def cublasSgemmEx(self, handle, stream, tail, **f):
        types = tuple(self._dtype("cublasSgemmEx", f.pop(x)) for x in ("atype", "btype", "ctype"))
        return self._gemm("cublasSgemmEx", handle, stream, f, types, F32)

    def cublasGemmEx(self, handle, stream, tail, **f):
        return self._ex("cublasGemmEx", handle, stream, f)

    def cublasGemmStridedBatchedEx(self, handle, stream, tail, **f):
        return self._ex("cublasGemmStridedBatchedEx", handle, stream, f)

    def cublasGemmBatchedEx(self, handle, stream, tail, **f):
        return self._ex("cublasGemmBatchedEx", handle, stream, f, batched="pointers")

    # ---- GEMV and dot products -----------------------------------------------------------------
    def _gemv(self, name, handle, stream, f, dtype):
        device = self._use(name, handle, stream, f).pointer_mode == 1
        trans, m, n, lda, incx, incy = f["trans"], f["m"], f["n"], f["lda"], f["incx"], f["incy"]
        if trans not in (0, 1, 2) or m < 0 or n < 0 or lda < max(1, m) or not incx or not incy:
            raise LibError(INVALID_VALUE, f"{name}: trans {trans}, m {m}, n {n}, lda {lda}, incx {incx}, incy {incy}")
        xlen, ylen = (n, m) if trans == 0 else (m, n)

        def work():
            alpha, beta = self._scalar(device, f["alpha"], dtype), self._scalar(device, f["beta"], dtype)
            a = self._matrices(f["A"], dtype, m, n, lda)[0].to(F64)
            a = a if trans == 0 else a.T
            y = self._vector(f["y"], dtype, ylen, incy)
            out = alpha * (a @ self._vector(f["x"], dtype, xlen, incx).to(F64))
            y.copy_(out + beta * y.to(F64) if beta != 0 else out)

        self.driver._run(stream, work)
        return 0

    def cublasSgemv_v2(self, handle, stream, tail, **f):
        return self._gemv("cublasSgemv_v2", handle, stream, f, F32)

    def cublasDgemv_v2(self, handle, stream, tail, **f):
        return self._gemv("cublasDgemv_v2", handle, stream, f, F64)

    def _dot(self, name, handle, stream, f, xt, yt, rt):
        h = self._use(name, handle, stream, f)
        n, incx, incy = f["n"], f["incx"], f["incy"]
        wide = torch.complex128 if rt.is_complex else F64

        def value():
            if n <= 0:
                return torch.zeros(1, dtype=rt)
            x, y = self._vector(f["x"], xt, n, incx), self._vector(f["y"], yt, n, incy)
            return (x.to(wide) * y.to(wide)).sum().reshape(1).to(rt)   # unconjugated, as Sdot/DotEx

        if h.pointer_mode == 0:                      # the result goes to the caller's memory: answered now
            return 0, value().numpy().tobytes() if rt != torch.bfloat16 else value().view(torch.int16).numpy().tobytes()
        self.driver._run(stream, lambda: torch.frombuffer(self.mem.view(f["result"], rt.itemsize), dtype=rt)
                         .copy_(value()))
        return 0

    def cublasSdot_v2(self, handle, stream, tail, **f):
        return self._dot("cublasSdot_v2", handle, stream, f, F32, F32, F32)

    def cublasDdot_v2(self, handle, stream, tail, **f):
        return self._dot("cublasDdot_v2", handle, stream, f, F64, F64, F64)

    def cublasDotEx(self, handle, stream, tail, **f):
        types = [self._dtype("cublasDotEx", f.pop(x)) for x in ("xtype", "ytype", "result_type")]
        f.pop("exec_type")
        return self._dot("cublasDotEx", handle, stream, f, *types)
