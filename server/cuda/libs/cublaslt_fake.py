"""cuBLASLt beside the fake driver: the matmul computed by torch on the CPU, over the fake device's memory.

D = epilogue(alpha * op(A) @ op(B) + beta * C (+ bias)) with each matrix read through its layout (rows,
cols, leading dimension, row or column order, batch count and stride) in fp32, fp16, bf16 or fp64;
epilogues DEFAULT, RELU, BIAS, RELU_BIAS, GELU, GELU_BIAS (cuBLASLt's GELU is the tanh form); host or
device scalars. The heuristic answers one algo, tagged, whose second word counts the session's heuristic
answers, so a test sees which queries reached the server. Descriptors are "materialized" (parsed and
kept by content) as the real library's are, so their count is observable and goes to zero at close.
"""
from __future__ import annotations

import struct

import numpy as np
import torch

from rgpu.protocol import lib_cublaslt as P

from . import LibError

DTYPES = {0: torch.float32, 1: torch.float64, 2: torch.float16, 14: torch.bfloat16}   # cudaDataType
ALGO_TAG = 0x52475055                       # "RGPU": the fake's algos, recognised when handed back
EPILOGUES = {1: (False, None), 2: (False, "relu"), 4: (True, None), 6: (True, "relu"), 32: (False, "gelu"),
             36: (True, "gelu")}            # cublasLtEpilogue_t -> (bias, activation)
COMPUTE64 = (70, 71)                         # CUBLAS_COMPUTE_64F(_PEDANTIC): accumulate in double
MAX_KEPT = 4096                              # descriptors kept, as the real side bounds its own
MAX_ELEMENTS = 1 << 26                       # per operand: the CPU's copy of it stays bounded


def _dtype(t: int) -> torch.dtype:
    if t not in DTYPES:
        raise LibError(P.NOT_SUPPORTED, f"data type {t} is not modelled by the fake cuBLASLt")
    return DTYPES[t]


class Library:
    def __init__(self, driver, owner):
        self.driver = driver
        self.owner = owner
        self.handles: set[int] = set()                       # made by cublasLtCreate
        self.materialized: dict[tuple, P.Obj] = {}             # (kind, content) -> descriptor
        self.served = 0

    def status_name(self, status: int) -> str:
        return P.STATUS.get(status, "unrecognized status")

    def live(self) -> int:
        """Descriptors and handles this session holds."""
        return len(self.materialized) + len(self.handles)

    def close(self) -> None:
        self.materialized.clear()
        self.handles.clear()

    # ---- handles ----------------------------------------------------------------------------
    def _handle(self, handle: int) -> None:
        if handle in self.handles:
            return
        try:
            cublas = self.owner.library("cublas")
        except Exception:      # noqa: BLE001  (no cuBLAS implementation here yet: our own handles only)
            cublas = None
        find = getattr(cublas, "handle_for_lt", None)
        if find is None or find(handle) is None:
            raise LibError(P.NOT_INITIALIZED, f"handle {handle:#x} is not a cuBLAS or cuBLASLt handle "
                                              "of this session")

    def cublasLtCreate(self, handle, stream, tail, client_version):
        self.handles.add(handle)
        return 0

    def cublasLtDestroy(self, handle, stream, tail):
        if handle not in self.handles:
            raise LibError(P.NOT_INITIALIZED, f"handle {handle:#x} was not created by cublasLtCreate")
        self.handles.discard(handle)
        return 0

    # ---- state -------------------------------------------------------------------------------
    def _state(self, tail, kinds: tuple[int, ...]) -> list:
        try:
            objs = P.parse_as(tail, kinds)
        except P.StateError as exc:
            raise LibError(P.INVALID_VALUE, str(exc)) from None
        for obj in objs:
            if obj is not None:                  # kept by content, as the real side keeps its descriptors
                if len(self.materialized) >= MAX_KEPT:
                    self.materialized.pop(next(iter(self.materialized)))
                self.materialized.setdefault(obj.key, obj)
        return objs

    def _shape(self, desc: P.Obj, layouts: list[P.Obj]) -> dict:
        """The problem the layouts describe, checked as cuBLASLt checks it."""
        a, b, c, d = ({"rows": L.int(P.LAYOUT_ROWS, signed=False), "cols": L.int(P.LAYOUT_COLS, signed=False),
                       "ld": L.int(P.LAYOUT_LD), "order": L.int(P.LAYOUT_ORDER), "type": L.int(P.LAYOUT_TYPE),
                       "batch": L.int(P.LAYOUT_BATCH_COUNT, 1), "stride": L.int(P.LAYOUT_BATCH_STRIDE)}
                      for L in layouts)
        ta, tb = desc.int(P.DESC_TRANSA), desc.int(P.DESC_TRANSB)
        m, k = (a["rows"], a["cols"]) if ta == 0 else (a["cols"], a["rows"])
        kb, n = (b["rows"], b["cols"]) if tb == 0 else (b["cols"], b["rows"])
        if k != kb or (c["rows"], c["cols"]) != (m, n) or (d["rows"], d["cols"]) != (m, n):
            raise LibError(P.INVALID_VALUE, f"op(A) {m}x{k}, op(B) {kb}x{n}, C {c['rows']}x{c['cols']}, "
                                            f"D {d['rows']}x{d['cols']} do not make a matmul")
        if min(m, n, k) < 1:
            raise LibError(P.NOT_SUPPORTED, f"an empty matmul ({m}x{k} @ {kb}x{n}) is not modelled by the fake cuBLASLt")
        for L in (a, b, c, d):
            least = L["rows"] if L["order"] == 0 else L["cols"]
            if (L["order"] not in (0, 1) or L["ld"] < max(1, least) or L["batch"] not in (1, d["batch"])
                    or L["stride"] < 0 or L["batch"] < 1):
                raise LibError(P.INVALID_VALUE, f"a layout the fake cannot read: {L}")
            if d["batch"] * L["rows"] * L["cols"] > MAX_ELEMENTS:   # a batch of stride 0 would read one matrix often
                raise LibError(P.NOT_SUPPORTED, f"a matmul of {d['batch']} x {L['rows']}x{L['cols']} is too big "
                                                "for the fake cuBLASLt")
            _dtype(L["type"])
        if desc.int(P.DESC_EPILOGUE, 1) not in EPILOGUES:
            raise LibError(P.NOT_SUPPORTED, f"epilogue {desc.int(P.DESC_EPILOGUE, 1)} is not modelled by "
                                            "the fake cuBLASLt")
        return {"a": a, "b": b, "c": c, "d": d, "ta": ta, "tb": tb, "batch": d["batch"]}

    def cublasLtMatmulAlgoGetHeuristic(self, handle, stream, tail, requested):
        self._handle(handle)
        if requested <= 0:
            raise LibError(P.INVALID_VALUE, f"{requested} algos requested")
        desc, *layouts, _pref = self._state(tail, (P.KIND_DESC,) + (P.KIND_LAYOUT,) * 4 + (P.KIND_PREF,))
        self._shape(desc, layouts)
        self.served += 1
        algo = struct.pack("<8Q", ALGO_TAG, self.served, 0, 0, 0, 0, 0, 0)
        return 0, algo + struct.pack("<QIf4i", 0, 0, 1.0, 0, 0, 0, 0)

    # ---- the matmul ---------------------------------------------------------------------------
    def _matrix(self, ptr: int, L: dict, batch: int) -> torch.Tensor:
        """The (batch, rows, cols) matrix at ``ptr`` read through its layout (a view: writes land in memory)."""
        dtype = DTYPES[L["type"]]
        stride = L["stride"] if L["batch"] > 1 else 0
        inner = (1, L["ld"]) if L["order"] == 0 else (L["ld"], 1)
        extent = (L["rows"] - 1) * inner[0] + (L["cols"] - 1) * inner[1] + (batch - 1) * stride + 1
        size = dtype.itemsize
        flat = torch.frombuffer(self.driver.mem.view(ptr, extent * size), dtype=dtype)
        return flat.as_strided((batch, L["rows"], L["cols"]), (stride, *inner))

    def _scalar(self, raw: bytes, ptr: int, scale: int) -> float:
        width = {0: 4, 1: 8, 2: 2, 14: 2}.get(scale)
        if width is None:
            raise LibError(P.NOT_SUPPORTED, f"scale type {scale} is not modelled by the fake cuBLASLt")
        data = bytes(self.driver.mem.view(ptr, width)) if ptr else raw[:width]
        if scale == 14:
            return float(np.frombuffer(b"\0\0" + data, "<f4")[0])       # bf16: the top half of a float
        return float(np.frombuffer(data, {0: "<f4", 1: "<f8", 2: "<f2"}[scale])[0])

    def cublasLtMatmul(self, handle, stream, tail, alpha, beta, alpha_ptr, beta_ptr, a, b, c, d, workspace,
                       workspace_size, algo, has_algo):
        self._handle(handle)
        desc, *layouts = self._state(tail, (P.KIND_DESC,) + (P.KIND_LAYOUT,) * 4)
        shape = self._shape(desc, layouts)
        if has_algo and struct.unpack_from("<Q", algo)[0] != ALGO_TAG:
            raise LibError(P.INVALID_VALUE, "an algo this server's heuristic did not answer")
        mode, scale = desc.int(P.DESC_POINTER_MODE), desc.int(P.DESC_SCALE_TYPE)
        if mode not in (0, 1):
            raise LibError(P.NOT_SUPPORTED, f"pointer mode {mode} is not modelled by the fake cuBLASLt")
        bias_on, act = EPILOGUES[desc.int(P.DESC_EPILOGUE, 1)]
        bias_ptr = desc.int(P.DESC_BIAS_POINTER, signed=False)
        if bias_on and not bias_ptr:
            raise LibError(P.INVALID_VALUE, "a bias epilogue without CUBLASLT_MATMUL_DESC_BIAS_POINTER")
        acc = torch.float64 if desc.int(P.DESC_COMPUTE_TYPE) in COMPUTE64 else torch.float32
        batch = shape["batch"]

        def work():
            al = self._scalar(alpha, alpha_ptr if mode else 0, scale)
            be = self._scalar(beta, beta_ptr if mode else 0, scale)
            A = self._matrix(a, shape["a"], batch).to(acc)
            B = self._matrix(b, shape["b"], batch).to(acc)
            A = A.transpose(1, 2) if shape["ta"] else A
            B = B.transpose(1, 2) if shape["tb"] else B
            out = al * torch.bmm(A, B)
            if be != 0:                      # beta 0: C is not read (it may hold anything)
                out = out + be * self._matrix(c, shape["c"], batch).to(acc)
            if bias_on:
                d_type = shape["d"]["type"]
                bias_type = desc.int(P.DESC_BIAS_DATA_TYPE, -1)
                L = {"type": d_type if bias_type == -1 else bias_type, "rows": shape["d"]["rows"], "cols": 1,
                     "ld": shape["d"]["rows"], "order": 0, "batch": batch,
                     "stride": desc.int(P.DESC_BIAS_BATCH_STRIDE)}
                out = out + self._matrix(bias_ptr, L, batch).to(acc)
            if act == "relu":
                out = torch.relu(out)
            elif act == "gelu":
                out = torch.nn.functional.gelu(out, approximate="tanh")
            D = self._matrix(d, shape["d"], batch)
            D.copy_(out.to(D.dtype))

        self.driver._run(stream, work)       # noqa: SLF001  (the fake's stream order: now, or into a capture)
        return 0
