"""rgpu's libcudart.so.13: its exports, its loud stubs, its state answered in C, and real nvcc programs through it.

The programs (``tests/cuda_programs``) are built with ``nvcc -cudart shared``
(PTX only, uncompressed, so the fake driver reads their kernels) and run
through ``rgpu intercept run`` against a local ``rgpu serve --cuda-driver
fake``; their printed values are compared with numpy's.  On a GPU host the
same programs, built for sm_90, are compared with their native run.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import clean_env
from cuda_programs import PROGRAMS, build as build_program, check
from test_cuda_programs import run
from test_cuda_support import build_shim_or_skip, cuda_headers_or_skip


@pytest.fixture(scope="module")
def cudart() -> Path:
    build_shim_or_skip()
    from rgpu.cuda_intercept import cudart_build
    return cudart_build.build()


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    from conftest import RunningServer
    server = RunningServer(tmp_path_factory.mktemp("rgpu-cudart-server"), ("--cuda-driver", "fake"))
    yield server
    server.stop()


def _dyn_syms(lib: Path) -> list[str]:
    if not shutil.which("readelf"):
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run(["readelf", "--dyn-syms", "-W", str(lib)], capture_output=True, text=True, check=True).stdout
    return [f[7] for f in (line.split() for line in out.splitlines()) if len(f) >= 8 and f[6] != "UND"
            and f[4] in ("GLOBAL", "WEAK") and f[5] == "DEFAULT"]


def test_every_export_carries_the_libcudart_version_node(cudart):
    syms = _dyn_syms(cudart)
    assert len(syms) > 400
    unversioned = [s for s in syms if not s.endswith("@@libcudart.so.13") and s != "libcudart.so.13"]
    assert not unversioned, unversioned[:10]
    soname = subprocess.run(["readelf", "-d", str(cudart)], capture_output=True, text=True).stdout
    assert "Library soname: [libcudart.so.13]" in soname and "[libcuda.so.1]" in soname and "$ORIGIN" in soname


def test_every_export_of_the_stock_runtime_is_there(cudart):
    from rgpu.cuda_intercept import cudart_gen
    have = {s.split("@")[0] for s in _dyn_syms(cudart)}
    missing = sorted(set(cudart_gen.stock_exports()) - have)
    assert not missing, missing
    header = set(cudart_gen.header_functions(cuda_headers_or_skip()))
    assert not header - have


STUB_SCRIPT = textwrap.dedent("""
    import ctypes, sys
    rt = ctypes.CDLL(sys.argv[1])
    rt.cudaGetErrorName.restype = rt.cudaGetErrorString.restype = ctypes.c_char_p
    first, second = rt.cudaArrayGetInfo(None, None, None, None), rt.cudaArrayGetInfo(None, None, None, None)
    peek, last, cleared = rt.cudaPeekAtLastError(), rt.cudaGetLastError(), rt.cudaGetLastError()
    v = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(v))
    print(first, second, peek, last, cleared, rt.cudaGetErrorName(801).decode(), "|",
          rt.cudaGetErrorString(1).decode(), "|", v.value, rt.cudaGetErrorName(100).decode())
""")


def test_an_unimplemented_call_returns_801_sets_the_last_error_and_says_its_name_once(cudart, tmp_path):
    script = tmp_path / "stub.py"
    script.write_text(STUB_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(cudart)], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["801", "801", "801", "801", "0", "cudaErrorNotSupported", "|", "invalid",
                                   "argument", "|", "13000", "cudaErrorNoDevice"]
    assert done.stderr.count("rgpu: cudaArrayGetInfo is not supported over rgpu (yet)") == 1, done.stderr


STATE_C = textwrap.dedent(r"""
    #include <cuda.h>
    #include <cuda_runtime_api.h>
    #include <stdio.h>
    #include <time.h>
    static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
    #define OK(call) do { int r_ = (int)(call); if (r_) { printf("error %s = %d\n", #call, r_); return 1; } } while (0)
    int main(void) {
        unsigned flags; int active = -1, dev = -1, n = 0;
        OK(cudaGetDeviceCount(&n));
        OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
        printf("before %d\n", active);
        OK(cudaFree(0));                                   /* the runtime's idiom: make the context */
        OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
        printf("after %d\n", active);
        cudaStream_t s;
        enum cudaStreamCaptureStatus st;
        unsigned long long id = 0;
        OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        OK(cudaStreamIsCapturing(s, &st));
        printf("idle %d\n", (int)st);
        OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        OK(cudaStreamIsCapturing(s, &st));
        OK(cudaStreamGetCaptureInfo(s, &st, &id, NULL, NULL, NULL, NULL));
        printf("capturing %d %d\n", (int)st, id != 0);
        cudaGraph_t g;
        OK(cudaStreamEndCapture(s, &g));
        OK(cudaStreamIsCapturing(s, &st));
        printf("ended %d\n", (int)st);
        enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
        OK(cudaThreadExchangeStreamCaptureMode(&mode));
        printf("mode %d\n", (int)mode);
        struct cudaDeviceProp p;
        OK(cudaGetDeviceProperties(&p, 0));
        printf("props %s %d.%d %d\n", p.name, p.major, p.minor, p.warpSize);
        int calls = 200000;
        double t0 = now();
        for (int i = 0; i < calls; i++) {
            OK(cudaGetDevice(&dev));
            OK(cudaGetLastError());
            OK(cudaStreamIsCapturing(s, &st));
            OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
            OK(cudaGetDeviceProperties(&p, 0));
        }
        printf("per_call_us %.3f\n", (now() - t0) / (5.0 * calls) * 1e6);
        return 0;
    }
""")


def test_the_hot_questions_are_answered_in_c(cudart, tmp_path, fake_server):
    include = cuda_headers_or_skip()
    src = tmp_path / "state.c"
    src.write_text(STATE_C)
    exe = tmp_path / "state"
    subprocess.run(["cc", "-O2", f"-I{include}", str(src), "-o", str(exe), f"-L{cudart.parent}",
                    "-l:libcudart.so.13", "-l:libcuda.so.1", f"-Wl,-rpath,{cudart.parent}"], check=True)
    done = run([exe], fake_server)
    assert done.returncode == 0, done.stdout + done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert (out["before"], out["after"], out["idle"], out["capturing"], out["ended"]) == ("0", "1", "0", "1 1", "0")
    assert out["mode"] == "0"                          # the thread's previous mode: global
    assert out["props"].startswith("rgpu fake device 9.0 32")
    # a Python entry costs microseconds and a round trip tens of them: these stay well under one
    assert float(out["per_call_us"]) < 1.0, out["per_call_us"]


@pytest.mark.parametrize("name", PROGRAMS)
def test_an_nvcc_program_runs_through_the_runtime_with_numpys_values(name, cudart, fake_server, tmp_path):
    exe = build_program(name, "ptx", tmp_path)
    done = run([exe], fake_server)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "not supported over rgpu" not in done.stderr, done.stderr
    check(name, done.stdout)


STATE_CU = textwrap.dedent(r"""
    // The runtime's state: the device is per thread; a kernel fault comes back at the next synchronising
    // call and stays (sticky), as CUDA's does.
    #include <cstdio>
    #include <thread>
    #include <cuda_runtime.h>
    extern "C" __global__ void not_in_the_fake(float *p) { p[threadIdx.x] = 1; }
    int main() {
        int n = 0, here = -1, there = -1;
        cudaGetDeviceCount(&n);
        cudaSetDevice(1);
        std::thread t([&] { cudaGetDevice(&there); cudaFree(0); });
        t.join();
        cudaGetDevice(&here);
        printf("devices %d here %d there %d\n", n, here, there);
        float *p;
        cudaMalloc(&p, 256);
        not_in_the_fake<<<1, 32>>>(p);
        int launch = cudaGetLastError();
        int sync = cudaDeviceSynchronize();
        int last = cudaGetLastError(), again = cudaGetLastError(), later = cudaMalloc(&p, 256);
        printf("launch %d sync %d last %d again %d later %d\n", launch, sync, last, again, later);
        return 0;
    }
""")


def test_the_device_is_per_thread_and_a_kernel_fault_is_reported_late_and_stays(cudart, tmp_path, start_server):
    from cuda_programs import nvcc_or_skip
    src = tmp_path / "state.cu"
    src.write_text(STATE_CU)
    exe = tmp_path / "state_cu"
    subprocess.run([nvcc_or_skip(), "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90", "-no-compress",
                    "-o", str(exe), str(src)], check=True, capture_output=True)
    done = run([exe], start_server("--cuda-driver", "fake", "--devices", "2"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "devices 2 here 1 there 0" in done.stdout, done.stdout
    # queued: the launch itself succeeds; the fault arrives at the sync and never clears
    assert "launch 0 sync 719 last 719 again 719 later 719" in done.stdout, done.stdout + done.stderr


LAUNCH_CU = textwrap.dedent(r"""
    #include <chrono>
    #include <cstdio>
    #include <cuda_runtime.h>
    extern "C" __global__ void noop() {}
    int main() {
        noop<<<1, 1>>>();                                   // the first: the fatbin loads, the layout is noted
        if (cudaDeviceSynchronize()) return 1;
        const int n = 20000;
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n; i++) noop<<<1, 32>>>();
        auto t1 = std::chrono::steady_clock::now();
        int sync = cudaDeviceSynchronize();
        printf("per_launch_us %.3f sync %d\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / n, sync);
        return 0;
    }
""")


def test_a_triple_chevron_launch_is_queued_in_c(cudart, tmp_path, fake_server):
    from cuda_programs import nvcc_or_skip
    src = tmp_path / "launch.cu"
    src.write_text(LAUNCH_CU)
    exe = tmp_path / "launch_cu"
    subprocess.run([nvcc_or_skip(), "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90", "-no-compress",
                    "-o", str(exe), str(src)], check=True, capture_output=True)
    done = run([exe], fake_server)
    assert done.returncode == 0, done.stdout + done.stderr
    per_launch, sync = done.stdout.split()[1], done.stdout.split()[3]
    assert sync == "0"
    # through Python a launch costs tens of microseconds; queued in C, a fraction of one (plus the batch posts)
    assert float(per_launch) < 5.0, done.stdout


MEMORY_CU = textwrap.dedent(r"""
    // Copies of every kind, pointer attributes, 2D copies and memsets, stream-ordered allocation, symbols,
    // function attributes, driver entry points: each line "name value..." for the test to read.
    #include <cstdio>
    #include <cstring>
    #include <cuda.h>
    #include <cuda_runtime.h>
    __device__ float table[8];
    extern "C" __global__ void noop() {}
    extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = a * x[i] + y[i];
    }
    #define OK(call) do { cudaError_t e_ = (call); if (e_) { printf("error %s %d\n", #call, (int)e_); return 1; } } while (0)
    int main() {
        float h[64], back[64], *d, *d2, *pinned;
        for (int i = 0; i < 64; i++) h[i] = i * 0.5f;
        OK(cudaMalloc(&d, sizeof h));
        OK(cudaMalloc(&d2, sizeof h));
        OK(cudaMallocHost(&pinned, sizeof h));
        OK(cudaMemcpy(d, h, sizeof h, cudaMemcpyDefault));              // host -> device, by the pointers
        OK(cudaMemcpy(d2, d, sizeof h, cudaMemcpyDefault));             // device -> device
        OK(cudaMemcpy(back, d2, sizeof h, cudaMemcpyDefault));          // device -> host
        printf("default %d\n", memcmp(back, h, sizeof h) == 0);
        cudaPointerAttributes a;
        int types[3];
        OK(cudaPointerGetAttributes(&a, d + 3)); types[0] = a.type;
        OK(cudaPointerGetAttributes(&a, pinned)); types[1] = a.type;
        OK(cudaPointerGetAttributes(&a, h)); types[2] = a.type;
        printf("types %d %d %d\n", types[0], types[1], types[2]);
        // a 4x8 window of an 8x8 matrix, both ways, through a pitched copy
        float win[32];
        OK(cudaMemcpy2D(win, 8 * sizeof(float), d, 8 * sizeof(float), 8 * sizeof(float), 4, cudaMemcpyDeviceToHost));
        OK(cudaMemset2D(d, 8 * sizeof(float), 0, 4 * sizeof(float), 8));
        OK(cudaMemcpy(back, d, sizeof h, cudaMemcpyDeviceToHost));
        printf("window %g %g zeroed %g %g kept %g\n", win[0], win[31], back[0], back[59], back[4]);
        cudaStream_t s;
        OK(cudaStreamCreate(&s));
        void *p;
        OK(cudaMallocAsync(&p, 256, s));
        OK(cudaMemsetAsync(p, 0x3f, 256, s));
        unsigned char bytes[4];
        OK(cudaMemcpyAsync(bytes, p, 4, cudaMemcpyDeviceToHost, s));
        OK(cudaStreamSynchronize(s));
        OK(cudaFreeAsync(p, s));
        printf("async %d %d query %d\n", bytes[0], bytes[3], (int)cudaStreamQuery(s));
        float t[8] = {1, 2, 3, 4, 5, 6, 7, 8}, tb[2];
        void *ta;
        size_t tsize;
        OK(cudaMemcpyToSymbol(table, t, sizeof t));
        OK(cudaMemcpyFromSymbol(tb, table, 2 * sizeof(float), 5 * sizeof(float)));
        OK(cudaGetSymbolAddress(&ta, table));
        OK(cudaGetSymbolSize(&tsize, table));
        printf("symbol %g %g size %zu address %d\n", tb[0], tb[1], tsize, ta != nullptr);
        printf("bad_symbol %d\n", (int)cudaMemcpyFromSymbol(tb, table, 4, 30));
        cudaGetLastError();
        cudaFuncAttributes fa;
        OK(cudaFuncGetAttributes(&fa, (const void *)noop));
        printf("func_attrs %d\n", fa.maxThreadsPerBlock > 0);
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult q;
        OK(cudaGetDriverEntryPoint("cuMemAlloc", &fn, cudaEnableDefault, &q));
        printf("entry %d %d\n", fn != nullptr, (int)q);
        int v = 0;
        OK(cudaDriverGetVersion(&v));
        printf("driver %d\n", v >= 13000);
        // the host-function launch forms (older objects, cudaLaunchKernelExC): y = 2x + y, twice
        float alpha = 2, ones[64];
        int n = 64;
        for (int i = 0; i < 64; i++) ones[i] = 1;
        OK(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice));
        OK(cudaMemcpy(d2, ones, sizeof ones, cudaMemcpyHostToDevice));
        void *args[] = {&alpha, &d, &d2, &n};
        OK(cudaLaunchKernel((const void *)saxpy, dim3(1), dim3(64), args, 0, nullptr));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(1);
        cfg.blockDim = dim3(64);
        OK(cudaLaunchKernelExC(&cfg, (const void *)saxpy, args));
        OK(cudaMemcpy(back, d2, sizeof back, cudaMemcpyDeviceToHost));
        printf("launch_forms %g %g\n", back[0], back[63]);
        return 0;
    }
""")


def test_copies_pointers_symbols_and_attributes_through_the_runtime(cudart, tmp_path, fake_server):
    from cuda_programs import nvcc_or_skip
    src = tmp_path / "memory.cu"
    src.write_text(MEMORY_CU)
    exe = tmp_path / "memory_cu"
    subprocess.run([nvcc_or_skip(), "-cudart", "shared", "-gencode", "arch=compute_90,code=compute_90", "-no-compress",
                    "-o", str(exe), str(src)], check=True, capture_output=True)
    done = run([exe], fake_server)
    assert done.returncode == 0, done.stdout + done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert out["default"] == "1"
    assert out["types"] == "2 1 0"                 # device, (page-locked) host, unregistered
    assert out["window"] == "0 15.5 zeroed 0 0 kept 2"
    assert out["async"] == "63 63 query 0"
    assert out["symbol"] == "6 7 size 32 address 1"
    assert out["bad_symbol"] == "1"                # cudaErrorInvalidValue: past the variable's end
    assert out["func_attrs"] == "1" and out["entry"] == "1 0" and out["driver"] == "1"
    assert out["launch_forms"] == "1 127"          # 1 + 2*0 + 2*0, and 1 + 2*31.5 + 2*31.5


EXPORT_TABLE_C = textwrap.dedent("""
    #include <stdio.h>
    typedef struct { char bytes[16]; } uuid_t_;
    int cuGetExportTable(const void **table, const uuid_t_ *id);
    int ask(void) { const void *t = (const void *)1; uuid_t_ id = {{0}}; int r = cuGetExportTable(&t, &id); return t ? -1 : r; }
""")


def test_a_library_asking_for_the_private_tables_is_named_in_the_refusal(cudart, tmp_path):
    src = tmp_path / "asker.c"
    src.write_text(EXPORT_TABLE_C)
    lib = tmp_path / "libcusparse.so.12"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(lib), f"-L{cudart.parent}", "-l:libcuda.so.1",
                    f"-Wl,-rpath,{cudart.parent}"], check=True)
    script = f"import ctypes; a = ctypes.CDLL({str(lib)!r}); print(a.ask(), a.ask())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.stdout.split() == ["801", "801"], done.stdout + done.stderr
    said = "rgpu: libcusparse.so.12 asked for the driver's private tables: sparse ops are not supported over rgpu"
    assert done.stderr.count(said) == 1, done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("name", PROGRAMS)
def test_an_nvcc_program_prints_through_rgpu_what_it_prints_natively(name, cudart, tmp_path, start_server):
    from rgpu.server.cuda import real_api
    if not real_api.candidates() or not shutil.which("nvidia-smi"):
        pytest.skip("needs an NVIDIA GPU and its driver (runs through the device tool, not in CI)")
    exe = build_program(name, "sm_90", tmp_path)
    native = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=clean_env())
    assert native.returncode == 0, native.stdout + native.stderr
    server = start_server("--cuda-driver", "real")
    done = run([exe], server)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    strip = re.compile(r"^elapsed\S* .*$", re.M)           # timings differ run to run
    assert strip.sub("", done.stdout) == strip.sub("", native.stdout)
