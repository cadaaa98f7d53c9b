"""Unchanged CUDA C programs through ``rgpu intercept run`` against a real ``rgpu serve`` (fake driver here).

Also the embedding pitfalls: a program that dlopen()s the driver RTLD_LOCAL,
and an interpreter that cannot start, which must fail every call, never
answer CUDA_SUCCESS.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap

import pytest

from conftest import clean_env
from test_cuda_support import VECADD_C, build_shim_or_skip, compile_c_program

DLOPEN_C = textwrap.dedent("""
    #include <dlfcn.h>
    #include <stdio.h>
    int main(void) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) { printf("dlopen: %s\\n", dlerror()); return 2; }
        int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
        int (*count)(int *) = (int (*)(int *))dlsym(h, "cuDeviceGetCount");
        int n = -1, r = init(0);
        int c = count(&n);
        printf("cuInit=%d cuDeviceGetCount=%d n=%d\\n", r, c, n);
        return 0;
    }
""")


@pytest.fixture(scope="module")
def shim():
    return build_shim_or_skip()


@pytest.fixture(scope="module")
def programs(shim, tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda-programs")
    (out / "cuda_dlopen.c").write_text(DLOPEN_C)
    return {"vecadd": compile_c_program(VECADD_C, out, shim.parent),
            "dlopen": compile_c_program(out / "cuda_dlopen.c", out, shim.parent)}


def run(argv, server=None, env=None, timeout=120):
    """Run through ``rgpu intercept run``; output goes to files, not pipes: a local server the
    program starts inherits them and lives a moment longer than the program."""
    extra = {"RGPU_SERVER": server.address, "RGPU_TOKEN": server.token} if server else {}
    extra.update(env or {})
    cmd = [sys.executable, "-m", "rgpu", "intercept", "run", "--", *map(str, argv)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=clean_env(**extra))
        rc = proc.wait(timeout)                 # reaped at once, so a local server sees its parent gone
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, rc, out.read(), err.read())


def test_a_driver_api_c_program_runs_unchanged_against_the_server(programs, rgpu_server):
    done = run([programs["vecadd"]], rgpu_server)
    assert done.returncode == 0, done.stderr
    assert "OK device=rgpu fake device" in done.stdout


def test_the_c_program_starts_a_local_server_when_none_is_named(programs):
    done = run([programs["vecadd"]])
    assert done.returncode == 0, done.stderr
    assert "OK device=" in done.stdout and "started a local server" in done.stderr


def test_a_program_that_dlopens_the_driver_rtld_local_still_starts_python(programs, rgpu_server):
    done = run([programs["dlopen"]], rgpu_server)
    assert done.returncode == 0, done.stderr
    assert "cuInit=0 cuDeviceGetCount=0 n=1" in done.stdout, done.stdout + done.stderr


def test_an_interpreter_that_cannot_start_fails_every_call_instead_of_succeeding(programs, tmp_path, rgpu_server):
    broken = tmp_path / "broken" / "rgpu"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken rgpu, on purpose')\n")
    done = run([programs["dlopen"]], rgpu_server, env={"PYTHONPATH": str(broken.parent)})
    assert "cuInit=3 cuDeviceGetCount=3" in done.stdout, done.stdout + done.stderr   # CUDA_ERROR_NOT_INITIALIZED
    assert "could not start its Python side" in done.stderr


def test_the_bench_mode_reports_its_timings_as_json(programs, rgpu_server):
    import json
    done = run([programs["vecadd"], "bench", "50"], rgpu_server)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["launches"] == 50 and figures["htod_64mib_ms"] > 0


NUMBA_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import cuda
    d = cuda.get_current_device()
    a = np.arange(1000, dtype=np.float32)
    s = cuda.stream()
    back = cuda.to_device(a, stream=s).copy_to_host(stream=s)
    s.synchronize()
    pinned = cuda.pinned_array(8, dtype=np.float32)
    pinned[:] = 2
    print("device", d.name, d.compute_capability, np.array_equal(back, a), cuda.to_device(pinned).copy_to_host().sum())
""")


def test_numba_finds_the_remote_device_and_moves_arrays_both_ways(tmp_path, rgpu_server):
    try:
        import numba.cuda  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"numba's CUDA target is not installed: {exc}")
    build_shim_or_skip()
    script = tmp_path / "numba_arrays.py"
    script.write_text(NUMBA_SCRIPT)
    done = run([sys.executable, script], rgpu_server)
    assert done.returncode == 0, done.stderr
    assert "device b'rgpu fake device' (9, 0) True 16.0" in done.stdout


FINALISED = textwrap.dedent("""
    import ctypes, sys
    sys.path.insert(0, {tests!r})
    from test_cuda_support import shim_in_process
    from rgpu.cuda_intercept import client, embed
    lib = shim_in_process()
    d = ctypes.c_uint64()
    embed._at_exit(client.get())                 # what interpreter exit runs
    import rgpu.cuda_intercept.registry as r
    r.IMPLS.clear()                              # were Python entered now, it would say so
    print("free", lib.cuMemFree_v2(ctypes.c_uint64(0x1234)), "alloc", lib.cuMemAlloc_v2(ctypes.byref(d),
          ctypes.c_size_t(64)), "name", lib.cuGetErrorName(1, ctypes.byref(ctypes.c_char_p())))
""")


def test_calls_after_python_has_finalised_are_answered_in_c(tmp_path):
    build_shim_or_skip()
    script = tmp_path / "finalised.py"
    script.write_text(FINALISED.format(tests=str(VECADD_C.parent.parent / "tests")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    assert "free 0 alloc 4 name 0" in done.stdout        # release: success; anything else: DEINITIALIZED
    assert "not implemented" not in done.stderr


CAPSULE_FIRST = textwrap.dedent("""
    import sys, _socket
    getattr(_socket.CAPI, "anything", None)     # the host has looked something up on a capsule
    sys.path.insert(0, {tests!r})
    from test_cuda_support import shim_in_process
    shim_in_process()
    print("started")
""")


def test_a_python_host_that_used_capsules_still_starts_the_interceptor(tmp_path):
    # cffi's start-up spin lock on Python 3.8-3.11 is the capsule type's cache tag: it must be reset first
    build_shim_or_skip()
    script = tmp_path / "capsule_first.py"
    script.write_text(CAPSULE_FIRST.format(tests=str(VECADD_C.parent.parent / "tests")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 0 and "started" in done.stdout, done.stderr


AT_EXIT_SCRIPT = textwrap.dedent("""
    import atexit, ctypes
    def late():   # registered first, so it runs after the interceptor's own exit handler
        cu = ctypes.CDLL("libcuda.so.1")
        ev = ctypes.c_void_p()
        ptr = ctypes.c_uint64()
        made = cu.cuEventCreate(ctypes.byref(ev), 0)
        print("after exit:", made, bool(ev.value), cu.cuEventRecord(ev, None), cu.cuEventDestroy_v2(ev),
              cu.cuMemAlloc_v2(ctypes.byref(ptr), 64), flush=True)
    atexit.register(late)
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    print("running", flush=True)
""")


def test_bookkeeping_calls_made_while_the_process_exits_succeed_and_new_work_is_refused(tmp_path, rgpu_server):
    # torch's pinned-memory cache records an event as a tensor dies at exit and aborts on an error there
    build_shim_or_skip()
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT_SCRIPT)
    done = run([sys.executable, script], rgpu_server)
    assert done.returncode == 0, done.stderr
    assert "after exit: 0 True 0 0 4" in done.stdout, done.stdout + done.stderr   # 4: CUDA_ERROR_DEINITIALIZED
