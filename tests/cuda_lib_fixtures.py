"""Shared pieces of the math-library record tests (test_cuda_lib_records{,_lt,_dnn}.py): the stand-in's sessions.

No GPU: NVIDIA's libraries are the bench's stand-in (bench/cuda_lib_standin.c), which logs every call it gets.
Each test runs in a forked child (``isolated``): the server loads the libraries RTLD_GLOBAL, and the stand-in's
cuBLAS and cuDNN symbols would then shadow the mock libraries other tests load into this process. A module
imports the fixture and the skip by name (``from cuda_lib_fixtures import folder, pytestmark``).
"""
from __future__ import annotations

import functools
import multiprocessing
import shutil
import traceback

import pytest

from rgpu.bench import cuda_lib_records as bench
from rgpu.protocol.cuda import LAUNCH, LAUNCH_KIND
from rgpu.protocol.cuda_libs import BY_NAME

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"),
                                reason="no C compiler (builds the stand-in library)")
CTX, S1, S2 = 0x7, 0x5100, 0x5200
DEFAULT = (1 << 64) - 1                 # cuBLAS's workspace size "the library's own pool"
HANDLE, PACK, PLAN = 0, 1, 2            # cudnn_real's kinds in the C table
PLAN2, PACK2 = 0x5247_0014, 0x5247_0015


def isolated(test):
    """Run ``test`` in a forked child (its fixtures made here first); its failure is this test's."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        ctx = multiprocessing.get_context("fork")
        done = ctx.Queue()

        def child():
            try:
                test(*args, **kwargs)
                done.put(None)
            except BaseException:       # noqa: BLE001 (the child's failure, whatever it is, goes back)
                done.put(traceback.format_exc())
        p = ctx.Process(target=child)
        p.start()
        p.join(240)
        assert not p.is_alive() and p.exitcode == 0, f"the child ended with {p.exitcode}"
        error = done.get(timeout=5)
        assert error is None, error
    return run


@pytest.fixture(scope="module")
def folder():
    return bench.standin_dir()


def session_of(folder, monkeypatch, native: str):
    """A stand-in session (``RGPU_NATIVE=native``), its stand-in logging (``session.std``)."""
    monkeypatch.setenv("RGPU_NATIVE", native)
    monkeypatch.setenv("RGPU_CUDA_LIB_DIR", folder)
    session = bench.Session(folder)
    session.std = bench.standin(folder)
    session.std.standin_record(1)
    return session


def call(session, what, handle, **f):
    """The call ``what`` answered through ``Libraries.run``, its fields given by name."""
    spec = BY_NAME[what]
    payload = spec.format.pack(*(f[n] for n, _ in spec.fields))      # (bench.pack: a field "name" clashes)
    return session.libs.run(spec.id, handle, 0, memoryview(payload), answered=True)


def dnn_session(folder, monkeypatch, native):
    """A stand-in session with a second plan and variant pack (PLAN2, PACK2) beside the bench's."""
    session = session_of(folder, monkeypatch, native)
    assert call(session, "cudnnBackendCreateDescriptor", PLAN2, type=5) == [0, None]
    assert call(session, "cudnnBackendCreateDescriptor", PACK2, type=16) == [0, None]
    return session


def gemm(name, stream=S1, handle=bench.HANDLE, **over) -> bytes:
    """A queued GEMM record of ``name``: the bench's 128-cubed shape, ``over`` changed."""
    f = dict(bench.GEMM, workspace_size=DEFAULT)
    if "Ex" in name and name != "cublasSgemmEx":
        f.update(atype=14, btype=14, ctype=14, compute_type=68, algo=-1)
    if "Strided" in name:
        f.update(bench.STRIDES)
    f.update(over)
    return bench.record(name, handle, stream, bench.pack(name, **f), ctx=CTX)


def launch(func, stream) -> bytes:
    return LAUNCH.pack(LAUNCH.size, LAUNCH_KIND, func, CTX, stream, 1, 1, 1, 32, 1, 1, 0, 0)


def run(session, records: bytes, monkeypatch) -> tuple[list[str], int]:
    """The standin's log of ``records`` through the executor's door, and how many reached ``Libraries.run``."""
    seen = []
    libs_run = session.libs.run
    monkeypatch.setattr(session.libs, "run", lambda *a, **k: seen.append(a[0]) or libs_run(*a, **k))
    session.std.standin_take()
    session.executor._launches(memoryview(bytearray(records)))
    return session.std.standin_take().decode().splitlines(), len(seen)
