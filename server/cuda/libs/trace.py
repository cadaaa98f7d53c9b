"""Math-library call traces: recorded where the GPU is, replayed against the fake libraries in CI.

``RGPU_CUDA_LIB_RECORD=FOLDER`` in the server's environment: each session writes
``FOLDER/<pid>-<n>.rgputrace``, every forwarded cuBLAS, cuBLASLt and cuDNN call ``Libraries.run`` runs
(its id, handle, payload, whether answered, status, output) and, for the calls whose operands the
fields and layouts describe (cuBLAS GEMMs and GEMVs, ``cublasLtMatmul``), the input bytes before the
call and the output bytes after, each with its allocation's range. Reading them waits for the stream,
so recording is slow (a test tool, never on in production); a call inside a graph capture is recorded
without bytes (its stream cannot be waited for).

``replay(path)`` runs the trace straight into the fake server's ``Libraries`` (not through the client
libraries: the payloads are what they sent, so the client's part is not what is checked here): the
recorded allocations are placed at their addresses, each call's inputs written before it, and after
it its status compared with the GPU's and its outputs with the GPU's values (``TOLERANCE``: the CPU's
float against the GPU's). Calls that compute on operands the trace holds no bytes for (cuDNN's
executions) are skipped and counted. At the end the session's handles and descriptors must be zero.

A file is gzip'd msgpack objects: a header ``{"version", "flavour", "pid"}``, one map per call, and a
footer ``{"end": True, "live": {...}}`` written when the session closes its libraries.
"""
from __future__ import annotations

import bisect
import gzip
import itertools
import os
import struct
import threading

import msgpack

from rgpu.protocol import lib_cublaslt as LT
from rgpu.protocol.cuda import NO_STREAM
from rgpu.protocol.cuda_libs import BY_NAME

VERSION = 1
# |replayed - recorded| <= ATOL + RTOL * |recorded|: fp32 GEMMs on the CPU against the GPU's kernels sum in
# another order (TF32 off); bf16/fp16 outputs are rounded once more, so their step is the tolerance
TOLERANCE = {"float32": (1e-4, 1e-3), "float64": (1e-12, 1e-10), "float16": (1e-2, 1e-2), "bfloat16": (2e-2, 2e-2)}
DTYPE = {0: ("float32", 4), 1: ("float64", 8), 2: ("float16", 2), 14: ("bfloat16", 2)}   # cudaDataType
_counter = itertools.count()


# ---- which bytes a call reads and writes ----------------------------------------------------------

def _matrix(es, rows, cols, ld, batch=1, stride=0) -> int:
    """Bytes of a column-major ``rows`` x ``cols`` matrix with leading dimension ``ld`` (and a batch)."""
    if rows <= 0 or cols <= 0 or batch <= 0:
        return 0
    return es * ((cols - 1) * ld + rows + (batch - 1) * stride)


def _gemm(name, f):
    if name == "cublasGemmBatchedEx":        # arrays of pointers: not followed
        return None
    types = (0, 0, 0) if name.startswith("cublasS") and "Ex" not in name else (1, 1, 1) if name.startswith("cublasD") \
        else (f["atype"], f["btype"], f["ctype"])
    if any(t not in DTYPE for t in types):
        return None
    (ta, ea), (_, eb), (tc, ec) = (DTYPE[t] for t in types)
    batch = f.get("batch", 1)
    ar, ac = (f["m"], f["k"]) if f["transa"] == 0 else (f["k"], f["m"])
    br, bc = (f["k"], f["n"]) if f["transb"] == 0 else (f["n"], f["k"])
    ins = [(f["A"], _matrix(ea, ar, ac, f["lda"], batch, f.get("stride_a", 0))),
           (f["B"], _matrix(eb, br, bc, f["ldb"], batch, f.get("stride_b", 0))),
           (f["C"], _matrix(ec, f["m"], f["n"], f["ldc"], batch, f.get("stride_c", 0)))]
    out = [(f["C"], ins[2][1], tc)]
    return ins + _device_scalars(f, 8 if tc == "float64" else 4), out


def _gemv(name, f):
    dt, es = DTYPE[1 if name.startswith("cublasD") else 0]
    xs, ys = (f["n"], f["m"]) if f["trans"] == 0 else (f["m"], f["n"])
    vec = lambda count, inc: es * (abs(inc) * (count - 1) + 1) if count > 0 else 0
    ins = [(f["A"], _matrix(es, f["m"], f["n"], f["lda"])), (f["x"], vec(xs, f["incx"])), (f["y"], vec(ys, f["incy"]))]
    return ins + _device_scalars(f, es), [(f["y"], ins[2][1], dt)]


def _device_scalars(f, size):
    if f.get("pointer_mode") != 1:
        return []
    return [(int.from_bytes(f[k][:8], "little"), size) for k in ("alpha", "beta")]


def _lt_matmul(f, tail):
    desc, *layouts = LT.parse_as(tail, (LT.KIND_DESC, LT.KIND_LAYOUT, LT.KIND_LAYOUT, LT.KIND_LAYOUT, LT.KIND_LAYOUT))
    sizes = []
    for ly in layouts:
        t = ly.int(LT.LAYOUT_TYPE)
        if t not in DTYPE or ly.int(LT.LAYOUT_ORDER) != 0:
            return None
        sizes.append((DTYPE[t][0], _matrix(DTYPE[t][1], ly.int(LT.LAYOUT_ROWS), ly.int(LT.LAYOUT_COLS),
                                           ly.int(LT.LAYOUT_LD), ly.int(LT.LAYOUT_BATCH_COUNT, 1),
                                           ly.int(LT.LAYOUT_BATCH_STRIDE))))
    ins = [(f[k], n) for k, (_, n) in zip("abc", sizes) if f[k]]
    bias = desc.int(LT.DESC_BIAS_POINTER, signed=False)
    if bias:
        bt = desc.int(LT.DESC_BIAS_DATA_TYPE, -1)
        es = DTYPE[bt][1] if bt in DTYPE else DTYPE[layouts[3].int(LT.LAYOUT_TYPE)][1]
        ins.append((bias, es * layouts[3].int(LT.LAYOUT_ROWS)))
    scale = 8 if desc.int(LT.DESC_SCALE_TYPE) == 1 else 4
    ins += [(f[k], scale) for k in ("alpha_ptr", "beta_ptr") if f[k]]
    return ins, [(f["d"], sizes[3][1], sizes[3][0])]


def operands(name: str, fields: dict, tail):
    """``(inputs [(ptr, nbytes)], outputs [(ptr, nbytes, dtype)])`` of a call whose operands its fields
    describe, else None (descriptor calls, cuDNN's executions)."""
    try:
        if name == "cublasLtMatmul":
            return _lt_matmul(fields, tail)
        if "gemm" in name.lower() and "A" in fields:
            return _gemm(name, fields)
        if "gemv" in name:
            return _gemv(name, fields)
    except (LT.StateError, KeyError, IndexError, struct.error):
        return None                           # the call itself will fail and say why
    return None


def _computes(name: str) -> bool:
    """Whether a call reads or writes device memory (so replaying it without its bytes is not possible)."""
    if any(w in name for w in ("Size", "Get", "Heuristic", "Create", "Destroy", "Set")):
        return False
    return any(w in name for w in ("gemm", "Gemm", "gemv", "dot", "Dot", "Matmul", "Execute", "Forward",
                                   "Backward", "Transform", "Add"))


def _with_algo(payload: bytes, algos: dict) -> bytes:
    """A cublasLtMatmul's payload with the GPU's algo (opaque to the fake) swapped for the one the fake's
    heuristic answered in its place, or none (the fake then picks its own: the same arithmetic)."""
    spec = BY_NAME["cublasLtMatmul"]
    names = [n for n, _ in spec.fields]
    f = dict(zip(names, spec.format.unpack_from(payload)))
    if f["has_algo"]:
        fake = algos.get(f["algo"])
        f["algo"], f["has_algo"] = (fake, 1) if fake else (bytes(LT.ALGO), 0)
    return spec.format.pack(*(f[n] for n in names)) + payload[spec.format.size:]


# ---- recording ------------------------------------------------------------------------------------

class Recorder:
    """One session's trace file; ``before``/``after`` bracket each call ``Libraries.run`` makes."""

    def __init__(self, driver, path: str):
        self.driver, self.path, self.lock, self.file = driver, path, threading.Lock(), None

    def _write(self, obj) -> None:
        with self.lock:
            if self.file is None:              # at the first call: a session that uses no library leaves no file
                self.file = gzip.open(self.path, "wb", compresslevel=6)
                head = {"version": VERSION, "flavour": getattr(self.driver, "name", "real"), "pid": os.getpid()}
                self.file.write(msgpack.packb(head, use_bin_type=True))
            self.file.write(msgpack.packb(obj, use_bin_type=True))

    def _read(self, spans) -> list:
        """``[ptr, allocation base, allocation size, bytes]`` of each span, the context waited for first."""
        self.driver.ctx_synchronize()
        out = []
        for ptr, n, *_ in spans:
            if ptr and n:
                base, size = self.driver.mem_get_address_range(ptr)
                out.append([ptr, base, size, bytes(self.driver.memcpy_dtoh(ptr, n, None))])
        return out

    def before(self, spec, handle, stream, payload, fields, answered) -> dict:
        tail = payload[spec.format.size:]
        rec = {"call": spec.id, "name": spec.name, "handle": handle, "answered": answered,
               "stream": None if stream == NO_STREAM else stream, "payload": bytes(payload)}
        ops = operands(spec.name, fields, tail)
        capturing = stream != NO_STREAM and stream and self.driver.stream_is_capturing(stream)
        if ops and not capturing:
            rec["inputs"], rec["_out"] = self._read(ops[0]), ops[1]
        elif ops:
            rec["captured"] = True
        return rec

    def after(self, rec, status, out, message) -> None:
        spans = rec.pop("_out", None)
        if spans and not status:
            rec["outputs"] = [r + [dt] for r, (_, _, dt) in zip(self._read(spans), spans)]
        rec.update(status=status, out=bytes(out) if out is not None else None, message=message)
        self._write(rec)

    def close(self, libs) -> None:
        if self.file is not None:
            self._write({"end": True, "live": live(libs)})
            self.file.close()


def recorder(driver):
    """A Recorder when RGPU_CUDA_LIB_RECORD names a folder, else None."""
    from rgpu import config
    folder = config.settings().cuda_lib_record
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    return Recorder(driver, os.path.join(folder, f"{os.getpid()}-{next(_counter)}.rgputrace"))


def live(libs) -> dict:
    """Handles and descriptors each loaded library still holds."""
    out = {}
    for prefix, lib in libs.open.items():
        if hasattr(lib, "counts"):
            out[prefix] = sum(lib.counts())
        elif hasattr(lib, "live"):
            out[prefix] = lib.live()
        else:
            out[prefix] = len(getattr(lib, "handles", ()))
    return out


def load(path) -> tuple[dict, list[dict], dict | None]:
    """The header, the calls and the footer (None when the session never closed its libraries)."""
    with gzip.open(path, "rb") as f:
        objs = list(msgpack.Unpacker(f, raw=False, strict_map_key=False))
    if not objs or objs[0].get("version") != VERSION:
        raise ValueError(f"{path}: not a version {VERSION} math-library trace")
    end = objs[-1] if objs[-1].get("end") else None
    return objs[0], objs[1:-1] if end else objs[1:], end


# ---- replaying ------------------------------------------------------------------------------------

def _place(mem, base: int, size: int) -> None:
    """An allocation of the fake's memory at a recorded address (overlapping older ones dropped: the GPU's
    allocator reused that range). FakeMemory has no such call of its own; only a replay needs one."""
    found = mem.find(base)
    if found and found[0] == base and len(found[1]) == size:
        return
    for start in [s for s in mem._starts if s < base + size and s + len(mem._blocks[s]) > base]:
        mem.free(start)
    mem._blocks[base] = bytearray(size)
    bisect.insort(mem._starts, base)
    mem.used += size


def _differs(got: bytes, want: bytes, dtype: str) -> float | None:
    """The largest |difference| past the tolerance (0.0 when within it), None when the sizes differ."""
    import torch
    if len(got) != len(want):
        return None
    dt = getattr(torch, dtype)
    a = torch.frombuffer(bytearray(got), dtype=dt).double()
    b = torch.frombuffer(bytearray(want), dtype=dt).double()
    atol, rtol = TOLERANCE[dtype]
    finite = a.isfinite() & b.isfinite()
    bad = finite & ((a - b).abs() > atol + rtol * b.abs())
    bad |= ~finite & (a != b) & ~(a.isnan() & b.isnan())     # inf against inf is equal, NaN against NaN too
    return float((a - b).abs()[bad].nan_to_num(float("inf")).max()) if bad.any() else 0.0


def replay(path) -> dict:
    """Run ``path``'s calls into a fresh fake session; a report of what matched and what did not."""
    from ..fake import FakeDriver
    from . import Libraries

    header, calls, end = load(path)
    driver = FakeDriver()
    driver.set_current(driver.primary_ctx_retain(0))
    libs = Libraries(driver)
    libs.recorder = None
    rep = {"path": str(path), "flavour": header.get("flavour"), "calls": len(calls), "replayed": 0,
           "skipped": {}, "status_mismatch": [], "compared": 0, "value_mismatch": [], "errors": [],
           "recorded_live_at_end": end and end.get("live")}
    algos: dict[bytes, bytes] = {}             # the GPU's heuristic's algos -> the fake's, as the replay met them
    for i, rec in enumerate(calls):
        name = rec["name"]
        if _computes(name) and "inputs" not in rec:
            why = "in a graph capture" if rec.get("captured") else "no operand bytes recorded"
            rep["skipped"][f"{name} ({why})"] = rep["skipped"].get(f"{name} ({why})", 0) + 1
            continue
        for ptr, base, size, data in rec.get("inputs", []):
            _place(driver.mem, base, size)
            driver.mem.view(ptr, len(data))[:] = data
        for _, base, size, *_ in rec.get("outputs", []):
            _place(driver.mem, base, size)
        payload = _with_algo(rec["payload"], algos) if name == "cublasLtMatmul" else rec["payload"]
        try:
            got = libs.run(rec["call"], rec["handle"], NO_STREAM, memoryview(payload), answered=True)
        except Exception as exc:
            rep["errors"].append(f"call {i} {name}: {type(exc).__name__}: {exc}"[:300])
            continue
        rep["replayed"] += 1
        status = got[-2]
        if name == "cublasLtMatmulAlgoGetHeuristic" and len(got) == 3 and rec.get("out"):
            mine, theirs = bytes(got[0]), rec["out"]        # result i of the GPU's for result i of the fake's
            for i in range(len(theirs) // LT.RESULT):
                j = min(i, len(mine) // LT.RESULT - 1)
                if j >= 0:
                    algos[theirs[i * LT.RESULT:i * LT.RESULT + LT.ALGO]] = mine[j * LT.RESULT:j * LT.RESULT + LT.ALGO]
        if status != (rec["status"] or 0):
            rep["status_mismatch"].append(f"call {i} {name}: GPU {rec['status']}, fake {status} ({got[-1]})")
            continue
        for ptr, _, _, want, dtype in rec.get("outputs", []):
            rep["compared"] += 1
            d = _differs(bytes(driver.mem.view(ptr, len(want))), want, dtype)
            if d != 0.0:
                rep["value_mismatch"].append(f"call {i} {name} at {ptr:#x} ({dtype}): "
                                             + ("size differs" if d is None else f"max |diff| {d:.3g}"))
    opened = list(libs.open.values())
    rep["live_before_close"] = live(libs)
    libs.close()
    rep["live_after_close"] = live(type("Closed", (), {"open": dict(enumerate(opened))})())
    rep["ok"] = not (rep["status_mismatch"] or rep["value_mismatch"] or rep["errors"]) and \
        not any(rep["live_after_close"].values())
    return rep


def trim(src, dst, most: int = 64 << 10) -> dict:
    """``src`` without the computing calls whose operands hold more than ``most`` bytes (each call's inputs are
    in the trace, so the calls kept replay the same): a trace small enough to commit."""
    header, calls, end = load(src)
    kept = [c for c in calls if sum(len(x[3]) for x in c.get("inputs", []) + c.get("outputs", [])) <= most]
    with gzip.open(dst, "wb", compresslevel=9) as f:
        for obj in (header, *kept, *([end] if end else [])):
            f.write(msgpack.packb(obj, use_bin_type=True))
    return {"calls": len(calls), "kept": len(kept), "bytes": os.path.getsize(dst)}


def main(argv=None) -> int:
    """``python -m rgpu.server.cuda.libs.trace replay FILE...`` (a report each, exit 1 if one fails) or
    ``trim SRC DST [MOST_BYTES]``."""
    import json
    import sys
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["trim"] and len(args) in (3, 4):
        print(json.dumps(trim(args[1], args[2], *(int(a) for a in args[3:]))))
        return 0
    if args[:1] == ["replay"] and len(args) > 1:
        reports = [replay(p) for p in args[1:]]
        print(json.dumps(reports, indent=1))
        return 0 if all(r["ok"] for r in reports) else 1
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
