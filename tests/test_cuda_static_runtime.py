"""Programs carrying the CUDA runtime linked statically (nvcc's default, CuPy's wheels) through rgpu.

A static runtime asks the driver for its private export tables (cuGetExportTable); rgpu's libcuda.so.1
serves them in C (cuda_intercept/export_tables.c).  Here: the test programs of tests/cuda_programs built
``-cudart static`` run unchanged through ``rgpu intercept run`` against the fake driver, values checked
against numpy; the integrity hash against the ZLUDA project's vectors; a slot rgpu does not implement
and a table it does not know fail loudly, by name.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import clean_env
from cuda_programs import HERE as PROGRAMS_DIR, PROGRAMS, check, nvcc_or_skip
from rgpu.server.cuda.base import CudaDriverError
from test_cuda_programs import run
from test_cuda_runtime_calls import over_shim  # noqa: F401  (the real driver's code over rgpu's libcuda.so.1)
from test_cuda_support import build_shim_or_skip

INTERCEPT = Path(__file__).resolve().parent.parent / "cuda_intercept"
STATIC_PTX = ["-cudart", "static", "-O2", "-gencode", "arch=compute_90,code=compute_90", "-no-compress"]
STATIC_SASS = ["-cudart", "static", "-O2", "-gencode", "arch=compute_90,code=sm_90"]   # the GPU check's flags


def build_static(name: str, out: Path, flags=STATIC_PTX) -> Path:
    """Program ``name`` of tests/cuda_programs built with the static runtime (PTX only: the fake reads it)."""
    compiler = nvcc_or_skip()
    source = PROGRAMS_DIR / f"{name}.cu"
    key = hashlib.sha256(source.read_bytes() + (PROGRAMS_DIR / "check.h").read_bytes() + " ".join(flags).encode())
    exe = out / f"{name}-static-{key.hexdigest()[:12]}"
    if not exe.exists():
        done = subprocess.run([compiler, *flags, f"-I{PROGRAMS_DIR}", "-o", str(exe), str(source)],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"nvcc failed for {name}:\n{done.stderr}"
    return exe


@pytest.fixture(scope="module")
def static_programs(tmp_path_factory):
    build_shim_or_skip()
    out = tmp_path_factory.mktemp("static-programs")
    return lambda name, flags=STATIC_PTX: build_static(name, out, flags)


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_program_on_the_static_runtime_runs_unchanged_with_numpys_values(name, static_programs, rgpu_server):
    exe = static_programs(name)
    needed = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout
    assert "libcudart" not in needed          # the runtime is inside the program: only the driver is ours
    done = run([exe], rgpu_server)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    check(name, done.stdout)
    assert "slot" not in done.stderr, done.stderr          # no table slot rgpu lacks was called


# ---- the static runtime loads its fatbins before it has a context -------------------------------------------
# It calls cuLibraryLoadData first and makes the primary context current only after; a kernel's parameter
# layout is read in a context (the driver picks the kernel's image by the context's device), so the layouts
# come with each kernel's look-up, in the context its launches run in.  The GPU check's build is SASS only.
def test_a_sass_only_static_program_fails_at_its_load_naming_the_missing_ptx_not_at_a_launch(static_programs,
                                                                                              rgpu_server):
    done = run([static_programs("saxpy", STATIC_SASS)], rgpu_server)
    assert done.returncode != 0, done.stdout
    assert "cuLibraryLoadData: CUresult 209" in done.stderr and "has no PTX" in done.stderr, done.stderr
    assert "cuLaunchKernel" not in done.stderr, done.stderr       # never a launch with sizes the client guessed


class SaxpyArgs(ctypes.Structure):       # saxpy(float a, const float *x, float *y, int n) as the C ABI lays it out
    _fields_ = [("a", ctypes.c_float), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("n", ctypes.c_int)]


def test_a_library_loaded_with_no_context_gets_its_kernels_layouts_in_the_context(over_shim):
    from cuda_programs import build, kernels_fatbin
    ctx = ctypes.c_void_p()
    over_shim.api("cuCtxGetCurrent", ctypes.byref(ctx))
    over_shim.set_current(0)
    try:
        lib = over_shim.library_load({}, memoryview(kernels_fatbin(build("saxpy"))))
        assert over_shim.library_kernels(lib) is None           # no context: no layout read, the look-up reads it
    finally:
        over_shim.set_current(ctx.value)
    k = over_shim.library_get_kernel(lib, "saxpy")
    want = [[getattr(SaxpyArgs, f).offset, getattr(SaxpyArgs, f).size] for f, _ in SaxpyArgs._fields_]
    assert over_shim.param_layout(k) == want


def test_a_layout_the_driver_will_not_give_is_an_error_naming_the_call_never_an_empty_layout(over_shim):
    with pytest.raises(CudaDriverError) as err:
        over_shim.param_layout(0xDEAD0)
    assert err.value.code == 400 and "cuFuncGetParamInfo of 0xdead0, parameter 0" in str(err.value)


# ---- the integrity hash, held to ZLUDA's vectors (dark_api/src/lib.rs tests) ---------------------------------
HASH_C = textwrap.dedent("""
    #include <stdio.h>
    #include "export_tables.h"
    static void put(const char *label, const uint8_t *s, int n) {
        printf("%s", label);
        for (int i = 0; i < n; i++) printf(" %02x", s[i]);
        printf("\\n");
    }
    int main(void) {
        rgpu_ih_state h;
        uint64_t out[2];
        memset(&h, 0, sizeof h);
        rgpu_ih_bytes(&h, rgpu_ih_key, 16, 0x36);
        put("pass2", h.s, 66);
        struct rgpu_ih_input in = {0x2f30, 12082, 0x002fa423, 0xf79c1000, 0x00007ffff6958240ull,
                                   0x00007ffff6958220ull, 0x00007ffff2aaf4a0ull, 0x682b9cee};
        rgpu_ih_bytes(&h, &in, sizeof in, 0);
        put("pass3", h.s, 66);
        static const uint8_t p4[66] = {@P4@};
        uint32_t words[4] = {0x8a2bfe9au, 0x382d25acu, 0xc5ae37eau, 0x5f32716du};
        struct rgpu_ih_device dev = {{0}, 0, 2, 0};
        memcpy(dev.uuid, words, 16);
        memcpy(h.s, p4, 66);
        rgpu_ih_bytes(&h, &dev, sizeof dev, 0);
        put("pass4", h.s, 66);
        static const uint8_t p5[66] = {@P5@};
        memcpy(h.s, p5, 66);
        rgpu_ih_finish(&h, out);
        put("pass5", h.s, 66);
        put("value", (const uint8_t *)out, 16);
        in.version = 12080;
        rgpu_integrity_hash(&in, &dev, 1, out);
        printf("fixed %016llx %016llx\\n", (unsigned long long)out[0], (unsigned long long)out[1]);
        return 0;
    }
""")

P4_IN = ("84fd9310c6dbb3bc49c225e7da6e226f9bbd8159c3019a7a2634390f2a5613b1f6bc7fa18f04a54d0d78ab20f823"
         "20a53f6736e2de8ae5dfe1f20394addc9ada00da")
P5_IN = ("3e4bf29571f56b5107bf4bf1040e8e0b5f4d300c0f0caefb48af23b5ea4cc2dbd7df887439581 63a1f7c9b207e7e94"
         "c88bc6b2380d077dbd90d53963eb1d4f400040").replace(" ", "")
EXPECTED = {
    "pass2": "8b219a49e86d1aeef237f9b54a8c3c75c71eee21cf298ae51383f4ec3304e2fdb02f09014ff7686d6946437eb62b21ed"
             "57a110860e60441e705f67d1eb67a13d003d",
    "pass3": "0afdabc9ff9ba0be4d303282744fa7489d2382a387fa6cdb9249d9b54b2b5e516ef7f94d288a640619b3e6bea4ec7e54"
             "6428d9e1d434c0a94988c96158dd66740074",
    "pass4": "1fd825d2dffa64c7b61aaf22b879fb960000000002000000000000007c9d46d21fd825d2ddfa64c7b61aaf22e617bd3a"
             "d7dd5f828c87ce8666afa0507a7dbbbc0c50",
    "pass5": "002353065e96f69c61aa962d2ecda858e9cac02e35ed5fcae10ecd1fd08e8b9c294d1c946bf710b0070891d61406c0ec"
             "e19c8e33d4e9435c860c724d2798917f007f",
    "value": "002353065e96f69c61aa962d2ecda858",
}


def _c_bytes(hexs: str) -> str:
    return ", ".join(f"0x{hexs[i:i + 2]}" for i in range(0, len(hexs), 2))


def test_the_integrity_hash_gives_zludas_values_pass_by_pass(tmp_path):
    src = tmp_path / "hash.c"
    src.write_text(HASH_C.replace("@P4@", _c_bytes(P4_IN)).replace("@P5@", _c_bytes(P5_IN)))
    subprocess.run(["cc", "-O2", "-Wall", "-Wno-unused-function", f"-I{INTERCEPT}", str(src), "-o", str(tmp_path / "h")],
                   check=True)
    out = subprocess.run([str(tmp_path / "h")], capture_output=True, text=True, check=True).stdout
    got = {label: "".join(rest) for label, *rest in (line.split() for line in out.splitlines())}
    for label, want in EXPECTED.items():
        assert got[label] == want, label
    assert got["fixed"] == "3341181c03cb675c8ed383aa1f4cd1e8"     # a version ending in 0: a fixed value


# ---- what rgpu does not serve fails loudly, by name -----------------------------------------------------------
ASK_C = textwrap.dedent("""
    #include <stdio.h>
    typedef struct { unsigned char bytes[16]; } uuid_t_;
    int cuGetExportTable(const void **table, const uuid_t_ *id);
    static const uuid_t_ CUDART = {{0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a,
                                    0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9}};
    long table_size(void) { const void *t = 0; return cuGetExportTable(&t, &CUDART) ? -1 : (long)((void **)t)[0]; }
    int unknown_slot(void) {
        const void *t = 0;
        if (cuGetExportTable(&t, &CUDART)) return -1;
        return ((int (*)(void *))((void **)t)[3])(0);
    }
    int unknown_table(void) { const void *t = (const void *)1; uuid_t_ id = {{1, 2, 3}}; int r = cuGetExportTable(&t, &id);
                              return t ? -1 : r; }
""")


def _asker(tmp_path, shim, name):
    src = tmp_path / "ask.c"
    src.write_text(ASK_C)
    lib = tmp_path / name
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(lib), f"-L{shim.parent}", "-l:libcuda.so.1",
                    f"-Wl,-rpath,{shim.parent}"], check=True)
    return lib


def _call(lib, *calls):
    script = f"import ctypes; a = ctypes.CDLL({str(lib)!r}); a.table_size.restype = ctypes.c_long; " \
             f"print(*[getattr(a, c)() for c in {list(calls)!r}])"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=clean_env())


def test_a_slot_rgpu_does_not_implement_fails_naming_the_table_and_slot(tmp_path):
    lib = _asker(tmp_path, build_shim_or_skip(), "libstaticapp.so")
    done = _call(lib, "table_size", "unknown_slot", "unknown_slot", "unknown_table")
    assert done.stdout.split() == [str(32 * ctypes.sizeof(ctypes.c_void_p)), "801", "801", "801"], done.stderr
    said = "rgpu: the driver's private table CUDART_INTERFACE, slot 3, was called: rgpu does not implement it"
    assert done.stderr.count(said) == 1, done.stderr
    assert "libstaticapp.so asked for the driver's private tables: rgpu does not serve that table" in done.stderr
    assert "(table 01020300000000000000000000000000)" in done.stderr


def test_a_library_rgpu_leaves_stock_is_refused_even_a_table_rgpu_serves(tmp_path):
    lib = _asker(tmp_path, build_shim_or_skip(), "libcufft.so.12")
    done = _call(lib, "table_size")
    assert done.stdout.split() == ["-1"], done.stderr
    assert "rgpu: libcufft.so.12 asked for the driver's private tables: FFTs (cuFFT) are not supported" in done.stderr


# ---- CuPy (its wheels carry the runtime statically), when this machine has it ---------------------------------
# The fake driver runs kernels it knows by name (server/cuda/fake_kernels.py), not PTX: the RawKernels here are
# real CUDA C under two of those names (saxpy; block_sum, a shared-memory reduction) and the arrays are copied
# in, so the fake computes what a GPU would.  NVRTC compiles on the client, to PTX (the fake reads no cubin).
CUPY_PY = textwrap.dedent("""
    import json
    import numpy as np
    import cupy as cp
    x_host = np.arange(1000, dtype=np.float32) * np.float32(0.25) - np.float32(3)
    x, y = cp.asarray(x_host), cp.asarray(np.ones(1000, dtype=np.float32))
    saxpy = cp.RawKernel(r'''extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i]; }''', "saxpy")
    saxpy((4,), (256,), (cp.float32(1.5), x, y, cp.int32(1000)))
    block_sum = cp.RawKernel(r'''extern "C" __global__ void block_sum(const float* src, float* out, int n) {
        extern __shared__ float s[];
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        s[threadIdx.x] = i < n ? src[i] : 0.0f;
        __syncthreads();
        for (int k = blockDim.x / 2; k > 0; k /= 2) {
            if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
            __syncthreads();
        }
        if (threadIdx.x == 0) out[blockIdx.x] = s[0]; }''', "block_sum")
    parts = cp.zeros(4, dtype=cp.float32)
    block_sum((4,), (256,), (x, parts, cp.int32(1000)), shared_mem=256 * 4)
    print(json.dumps({"x": cp.asnumpy(x).tolist(), "y": cp.asnumpy(y).tolist(), "parts": cp.asnumpy(parts).tolist()}))
""")


def test_cupy_raw_kernels_and_copies_run_through_rgpu_with_numpys_values(rgpu_server, tmp_path):
    build_shim_or_skip()
    probe = subprocess.run([sys.executable, "-c", "import cupy; from cupy_backends.cuda.libs import nvrtc; nvrtc.getVersion()"],
                           capture_output=True, text=True, env=clean_env())
    if probe.returncode:
        pytest.skip(f"CuPy (with NVRTC) is not importable here: {probe.stderr.strip().splitlines()[-1:]}")
    script = tmp_path / "cupy_check.py"
    script.write_text(CUPY_PY)
    env = {"CUPY_COMPILE_WITH_PTX": "1"}
    if "CUDA_PATH" not in os.environ:               # CuPy looks for the toolkit's headers there
        from rgpu.cuda_intercept import header
        env["CUDA_PATH"] = str(Path(header.find_include_dir()).parent)
    done = run([sys.executable, script], rgpu_server, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    x = np.arange(1000, dtype=np.float32) * np.float32(0.25) - np.float32(3)
    np.testing.assert_array_equal(np.array(got["x"], dtype=np.float32), x)
    np.testing.assert_allclose(np.array(got["y"], dtype=np.float32), np.float32(1.5) * x + np.float32(1), rtol=1e-6)
    parts = np.pad(x, (0, 24)).reshape(4, 256).sum(axis=1, dtype=np.float64)
    np.testing.assert_allclose(np.array(got["parts"]), parts, rtol=1e-5, atol=1e-4)
