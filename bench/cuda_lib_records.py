"""The server's own cost per queued math-library record (cuBLAS, cuBLASLt, cuDNN) on the cuda route.

``python -m rgpu.bench.cuda_lib_records --json``. No GPU: NVIDIA's libraries are replaced by a stand-in
that does nothing (``cuda_lib_standin.c``, loaded by ``server/cuda/libs/loading.py`` from
``RGPU_CUDA_LIB_DIR`` as libcublas.so.13, libcublasLt.so.13 and libcudnn.so.9), so what is timed is the
server's work between a record's bytes and the library's function: unpacking, handle mapping, setters.

Each row is one record kind, ``batch`` records in one buffer, timed per record through the executor's
door for queued records (``Executor._launches``: the C walker where it is built, which runs the GEMMs, the
cuBLASLt matmuls, the cuDNN variant packs and executes after each state's or plan's first, else Python),
beside ``Libraries.run`` called per record (the Python path a queued record took before the C walker ran
them). ``metric`` is ``time`` in microseconds per record; the ``cudnn convolution`` row's per convolution:
its seven records as cudnn-frontend queues them (a variant pack made, three sets, finalized, the execute,
the pack destroyed); the ``cudnn batch norm`` row's per batch norm: its ten records (three legacy tensor
descriptors made, set or derived, the forward training pass, the three destroyed).
"""
from __future__ import annotations

import ctypes
import os
import struct
import tempfile
import time
from pathlib import Path

from rgpu.bench import harness

SOURCE = Path(__file__).resolve().parent / "cuda_lib_standin.c"
SONAMES = ("libcublas.so.13", "libcublasLt.so.13", "libcudnn.so.9")
HANDLE, LT_HANDLE, DNN_HANDLE, PLAN, PACK = 0x52475055_00000001, 0x52475055_00000002, 0x5247_0003, 0x5247_0004, 0x5247_0005
CONV_PACK = 0x5247_0006                 # the convolution row's variant pack: made and destroyed per convolution
BN_TENSORS = (0x5247_0007, 0x5247_0008, 0x5247_0009)    # the batch norm row's x, parameters and y descriptors


def standin_dir() -> str:
    """A folder holding the stand-in under the three libraries' names (built once, cached)."""
    from rgpu import native
    built = native.build_library("cuda_lib_standin", [SOURCE])
    folder = Path(tempfile.mkdtemp(prefix="rgpu-standin-"))
    for soname in SONAMES:
        (folder / soname).symlink_to(built)
    return str(folder)


def standin(folder: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(os.path.join(folder, SONAMES[0]))
    lib.standin_take.restype = ctypes.c_char_p
    lib.standin_calls.restype = ctypes.c_ulonglong
    return lib


def pack(name: str, **over) -> bytes:
    """``name``'s payload: its fixed fields (zero unless given; the library's own workspace), then ``tail``."""
    from rgpu.protocol.cuda_libs import BY_NAME
    spec = BY_NAME[name]
    f = {n: (b"\0" * int(code[:-1]) if code.endswith("s") else 0) for n, code in spec.fields}
    if "workspace_size" in f and name.startswith("cublas") and not name.startswith("cublasLt"):
        f["workspace_size"] = (1 << 64) - 1
    tail = over.pop("tail", b"")
    f.update(over)
    return spec.format.pack(*(f[n] for n, _ in spec.fields)) + tail


def record(name: str, handle: int, stream: int, payload: bytes, ctx: int = 0) -> bytes:
    """One queued record (``rgpu.protocol.cuda.OP``, LIB_KIND) carrying ``payload``, padded to 8 bytes."""
    from rgpu.protocol.cuda import LIB_KIND, OP
    from rgpu.protocol.cuda_libs import BY_NAME
    size = (OP.size + len(payload) + 7) // 8 * 8
    return (OP.pack(size, LIB_KIND, ctx, stream, BY_NAME[name].id, handle, len(payload)) + payload).ljust(size, b"\0")


def conv_records(handle: int, stream: int, plan: int, pack: int, ptrs=(0xA000, 0xB000, 0xC000), ctx: int = 0,
                 tail: bytes = b"", workspace: int = 0xE000, destroy: bool = True) -> bytes:
    """One convolution's queued records, as cudnn-frontend sends them per execution: a variant pack made,
    its data pointers, unique ids (1, 2, ...) and workspace set, finalized, ``plan`` executed on it (``tail``:
    by-value bytes), the pack destroyed."""
    n = len(ptrs)
    sets = ((1001, 6, struct.pack(f"<{n}Q", *ptrs)), (1000, 3, struct.pack(f"<{n}q", *range(1, n + 1))),
            (1003, 6, struct.pack("<Q", workspace)))
    out = [record("cudnnBackendCreateDescriptor", pack, 0, pack_of("cudnnBackendCreateDescriptor", type=16), ctx)]
    out += [record("cudnnBackendSetAttribute", pack, 0, struct.pack("<iiq", a, t, len(v) // 8) + v, ctx)
            for a, t, v in sets]
    out += [record("cudnnBackendFinalizeQueued", pack, 0, b"", ctx),
            record("cudnnBackendExecute", handle, stream, pack_of("cudnnBackendExecute", plan=plan, pack=pack,
                                                                   tail=tail), ctx)]
    if destroy:
        out.append(record("cudnnBackendDestroyDescriptor", pack, 0, b"", ctx))
    return b"".join(out)


def bn_records(handle: int, stream: int, x: int, bn: int, y: int, dims=(16, 32, 32, 32), ctx: int = 0) -> bytes:
    """One batch norm's records as torch queues them: x and y's legacy tensor descriptors made and set, the
    parameters' derived from x, the forward training pass, the three destroyed."""
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    nd = struct.pack(f"<ii{2 * len(dims)}i", 0, len(dims), *dims, *strides)
    made = [record("cudnnCreateTensorDescriptor", t, 0, b"", ctx) for t in (x, bn, y)]
    return b"".join([made[0], record("cudnnSetTensorNdDescriptor", x, 0, nd, ctx), made[1],
                     record("cudnnDeriveBNTensorDescriptor", bn, 0, struct.pack("<Qi", x, 2), ctx), made[2],
                     record("cudnnSetTensorNdDescriptor", y, 0, nd, ctx),
                     record("cudnnBatchNormalizationForwardTrainingEx", handle, stream, pack_of(
                         "cudnnBatchNormalizationForwardTrainingEx", mode=2, alpha=1.0, x=x, x_data=0xA000, y=y,
                         y_data=0xC000, bn=bn, scale=0xD000, bias=0xD100, factor=0.1, epsilon=1e-5), ctx),
                     *(record("cudnnDestroyTensorDescriptor", t, 0, b"", ctx) for t in (x, bn, y))])


pack_of = pack                          # (conv_records' argument "pack" is a descriptor id)
SCALAR = struct.pack("<f", 1.0).ljust(16, b"\0")
GEMM = dict(transa=0, transb=1, m=128, n=128, k=128, lda=128, ldb=128, ldc=128, A=0xA000, B=0xB000, C=0xC000,
            alpha=SCALAR, beta=bytes(16))
EX = dict(GEMM, atype=14, btype=14, ctype=14, compute_type=68, algo=-1)
STRIDES = dict(stride_a=16384, stride_b=16384, stride_c=16384, batch=4)


def _lt_state() -> bytes:
    i32, u64 = (lambda v: struct.pack("<i", v)), (lambda v: struct.pack("<Q", v))

    def obj(kind, attrs):
        body = b"".join(struct.pack("<II", a, len(v)) + v for a, v in sorted(attrs.items()))
        return struct.pack("<II", kind, len(body)) + body
    desc = obj(1, {0: i32(68), 1: i32(0), 7: i32(4), 8: u64(0xBEEF00)})      # bias epilogue, its pointer
    layout = obj(2, {0: i32(0), 2: u64(128), 3: u64(128), 4: u64(128)})
    return desc + layout * 4


def cases() -> dict[str, tuple[str, int, int, bytes]]:
    """Record kind -> (call, handle, stream, payload), as a steady training step sends them; the call None:
    ``payload`` is whole records (a convolution's seven)."""
    return {
        "cublasGemmEx": ("cublasGemmEx", HANDLE, 0x5000, pack("cublasGemmEx", **EX)),
        "cublasSgemm_v2": ("cublasSgemm_v2", HANDLE, 0x5000, pack("cublasSgemm_v2", **GEMM)),
        "cublasGemmStridedBatchedEx": ("cublasGemmStridedBatchedEx", HANDLE, 0x5000,
                                       pack("cublasGemmStridedBatchedEx", **EX, **STRIDES)),
        "cublasLtMatmul": ("cublasLtMatmul", HANDLE, 0x5000,
                           pack("cublasLtMatmul", alpha=SCALAR, a=0xA000, b=0xB000, c=0xC000, d=0xC000,
                                workspace=0xD000, workspace_size=1 << 20, tail=_lt_state())),
        "cudnnBackendExecute": ("cudnnBackendExecute", DNN_HANDLE, 0x5000,
                                pack("cudnnBackendExecute", plan=PLAN, pack=PACK)),
        "cudnn convolution": (None, DNN_HANDLE, 0x5000, conv_records(DNN_HANDLE, 0x5000, PLAN, CONV_PACK)),
        "cudnn batch norm": (None, DNN_HANDLE, 0x5000, bn_records(DNN_HANDLE, 0x5000, *BN_TENSORS)),
    }


class Session:
    """A cuda route executor over a driver that launches nothing, its math libraries the stand-in."""

    def __init__(self, folder: str):
        from rgpu.protocol.cuda_libs import BY_NAME
        from rgpu.server.cuda.executor import Executor
        os.environ["RGPU_CUDA_LIB_DIR"] = folder
        self.executor = Executor.__new__(Executor)      # no session: only the records' door is used
        self.executor.driver = _NoDriver(folder)
        self.executor.current, self.executor.deferred = 0, []
        self.executor.slow = None                       # no wait report: records are not counted
        from rgpu.server.cuda.libs import Libraries
        self.executor.libs = self.libs = Libraries(self.executor.driver)
        self.executor.driver.lib.standin_reset()        # this session's objects at the same addresses as the last's
        run = lambda name, handle, **f: self.libs.run(BY_NAME[name].id, handle, 0, memoryview(pack(name, **f)),  # noqa: E731
                                                       answered=True)
        assert run("cublasCreate_v2", HANDLE, client_version=130100)[1] == 0
        assert run("cudnnCreate", DNN_HANDLE, client_version=91000) == [0, None]
        assert run("cudnnBackendCreateDescriptor", PLAN, type=5) == [0, None]      # an execution plan
        assert run("cudnnBackendCreateDescriptor", PACK, type=16) == [0, None]     # a variant pack

    def per_record(self, name: str | None, handle: int, stream: int, payload: bytes, n: int) -> float:
        """µs per record (name None: per ``payload``'s records) through ``Libraries.run``, called once per record."""
        from rgpu.protocol.cuda import OP
        from rgpu.protocol.cuda_libs import BY_NAME
        if name is None:                    # whole records: each one's call, handle, stream and payload
            one, pos = [], 0
            while pos < len(payload):
                size, _, _, s, call, h, nbytes = OP.unpack_from(payload, pos)
                one.append((call, h, s, memoryview(payload[pos + OP.size:pos + OP.size + nbytes])))
                pos += size
        else:
            one = [(BY_NAME[name].id, handle, stream, memoryview(payload))]
        run = self.libs.run
        t = time.perf_counter()
        for _ in range(n):
            for call, h, s, view in one:
                run(call, h, s, view, answered=False)
        return (time.perf_counter() - t) / n * 1e6

    def batched(self, name: str | None, handle: int, stream: int, payload: bytes, n: int) -> float:
        """µs per record (name None: per ``payload``'s records) through the executor's door for a buffer of
        ``n`` of them."""
        records = memoryview(bytearray((payload if name is None else record(name, handle, stream, payload)) * n))
        t = time.perf_counter()
        self.executor._launches(records)
        elapsed = time.perf_counter() - t
        if self.executor.deferred:
            raise RuntimeError(f"{name}: {self.executor.deferred[:1]}")
        return elapsed / n * 1e6


class _NoDriver:
    """The real driver's name (so the real libraries' implementations load) and its C record walker, whose
    launches and context switches are the stand-in's, doing nothing; None without a C compiler."""
    name = "real"
    launch_at = None

    def __init__(self, folder: str):
        from rgpu.server.cuda import real_batch
        c = real_batch.library()
        self.walk = c.rgpu_walk_records if c is not None else None
        self.lib = lib = standin(folder)
        self.fns = (ctypes.cast(lib.standin_launch, ctypes.c_void_p), ctypes.cast(lib.standin_set_ctx, ctypes.c_void_p))

    def set_current(self, ctx):
        self.lib.standin_set_ctx(ctypes.c_void_p(ctx))

    def launch(self, func, grid, block, shared, stream, attrs, args):
        """The executor's Python path for a launch (no C walker): the stand-in's, as the walker would."""
        self.lib.standin_launch(ctypes.c_void_p(func), *grid, *block, shared, ctypes.c_void_p(stream), None, None)

    def launch_records(self, base, length, pos, ctx, cublas=None):
        if self.walk is None:
            return None
        p, c = ctypes.c_size_t(pos), ctypes.c_uint64((1 << 64) - 1 if ctx is None else ctx)
        rc = self.walk(*self.fns, base, length, ctypes.byref(p), ctypes.byref(c), cublas)
        return p.value, c.value, rc


def rows(args) -> list[dict]:
    folder = standin_dir()
    session = Session(folder)
    n = 2000 if args.quick else 20000
    out = []
    for kind, (name, handle, stream, payload) in cases().items():
        session.batched(name, handle, stream, payload, 100)          # warm: descriptors made, setters applied
        result = harness.compare(lambda: session.batched(name, handle, stream, payload, n),
                                 lambda: session.per_record(name, handle, stream, payload, n),
                                 repeats=harness.repeats_of(args, 5))
        out.append(harness.row(f"lib record {kind}", None, "time", len(payload), result,
                               "Libraries.run per record", unit="us", record=kind, batch=n))
    session.libs.close()
    return out


def main(argv=None) -> int:
    return harness.main(rows, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
