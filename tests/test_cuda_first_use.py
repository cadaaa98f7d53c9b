"""A kernel's first use costs few round trips: layouts come with the library, attributes in one reply, and
(RGPU_CUDA_LAZY_LIBRARIES) a library the program never uses is never loaded.

Counted on the loopback's round trips (the shim in this process, fake driver) and, for nvcc's static
runtime, by the program's ``RGPU_CUDA_WAIT_REPORT``; values against numpy and the PTX's own declarations.
"""
from __future__ import annotations

import ctypes
import re
from ctypes import byref, c_float, c_int, c_size_t, c_uint, c_void_p

import numpy as np
import pytest

from cuda_programs import build, check, kernels_fatbin
from test_cuda_images import cu, route  # noqa: F401  (fixtures)

CUDA_ERROR_NOT_FOUND = 500


def trips() -> int:
    from rgpu.cuda_intercept import client
    return client.get().conn.stats["round_trips"]


def load(cu, image: bytes) -> c_void_p:
    lib = c_void_p()
    assert cu.cuLibraryLoadData(byref(lib), ctypes.c_char_p(image), None, None, 0, None, None, 0) == 0
    return lib


def saxpy_values(cu, k) -> None:
    """Launch ``saxpy(a, x, y, n)`` (graph.cu's: y = a*x + y) and check it against numpy."""
    n = 64
    x, y = np.arange(n, dtype=np.float32), np.full(n, 1, np.float32)
    dx, dy = ctypes.c_uint64(), ctypes.c_uint64()
    for d, host in ((dx, x), (dy, y)):
        assert cu.cuMemAlloc_v2(byref(d), c_size_t(4 * n)) == 0
        assert cu.cuMemcpyHtoD_v2(d, host.ctypes.data_as(c_void_p), c_size_t(4 * n)) == 0
    a, cnt = c_float(3), c_int(n)
    params = (c_void_p * 4)(*[ctypes.cast(byref(v), c_void_p) for v in (a, dx, dy, cnt)])
    assert cu.cuLaunchKernel(k, c_uint(1), 1, 1, c_uint(64), 1, 1, 0, None, params, None) == 0
    out = np.empty_like(y)
    assert cu.cuMemcpyDtoH_v2(out.ctypes.data_as(c_void_p), dy, c_size_t(4 * n)) == 0
    assert np.array_equal(out, 3 * x + 1)
    for d in (dx, dy):
        assert cu.cuMemFree_v2(d) == 0


# ---- the server: a library's kernels with its load ------------------------------------------------------
def test_a_librarys_load_brings_every_kernels_handle_and_the_layout_its_ptx_declares(route):
    import hashlib
    ex, ctx = route()
    image = kernels_fatbin(build("graph"))
    meta = ["image_load", ctx, "library_kernels", {}, hashlib.sha256(image).hexdigest(), len(image)]
    code, value, _ = ex.handle(meta, [memoryview(image)], True)[0]
    assert code == 0, value
    lib, kernels = value
    assert sorted(kernels) == ["saxpy", "scale_shift"]
    # saxpy(float a, const float *x, float *y, int n): 4 bytes, then 8-aligned pointers, then the int
    assert kernels["saxpy"][1] == [[0, 4], [8, 8], [16, 8], [24, 4]]
    for name, (k, layout) in kernels.items():     # the same kernel the per-name look-up finds
        assert ex.handle(["library_get_kernel_layout", ctx, lib, name], [], True)[0][:2] == [0, [k, layout]]


def test_all_attributes_in_one_reply_equal_each_asked_alone(route):
    import hashlib
    ex, ctx = route()
    image = kernels_fatbin(build("graph"))
    meta = ["image_load", ctx, "library", {}, hashlib.sha256(image).hexdigest(), len(image)]
    lib = ex.handle(meta, [memoryview(image)], True)[0][1]
    k = ex.handle(["library_get_kernel", ctx, lib, "saxpy"], [], True)[0][1]
    assert ex.handle(["kernel_set_attribute", ctx, 8, 70000, k, 0], [], True)[0][0] == 0
    code, got, _ = ex.handle(["kernel_get_attributes", ctx, k, 0], [], True)[0]
    assert code == 0 and len(got) == 10 and None not in got and got[8] == 70000
    for attr, value in enumerate(got):
        assert ex.handle(["kernel_get_attribute", ctx, attr, k, 0], [], True)[0][:2] == [0, value]
        assert ex.handle(["func_get_attribute", ctx, attr, k], [], True)[0][:2] == [0, value]
    assert ex.handle(["func_get_attributes", ctx, k], [], True)[0][1] == got


# ---- through rgpu's libcuda.so.1 ------------------------------------------------------------------------
def test_a_kernel_look_up_is_answered_here_after_the_librarys_load(cu):
    lib = load(cu, kernels_fatbin(build("graph")))
    before = trips()
    k, missing = c_void_p(), c_void_p()
    assert cu.cuLibraryGetKernel(byref(k), lib, b"saxpy") == 0
    assert cu.cuLibraryGetKernel(byref(missing), lib, b"no_such_kernel") == CUDA_ERROR_NOT_FOUND
    offset, size = c_size_t(), c_size_t()
    assert cu.cuKernelGetParamInfo(k, 3, byref(offset), byref(size)) == 0 and (offset.value, size.value) == (24, 4)
    assert trips() == before                        # none: the load's reply carried them
    saxpy_values(cu, k)
    assert cu.cuLibraryUnload(lib) == 0


def test_cudaFuncGetAttributes_ten_reads_cost_one_round_trip(cu):
    lib = load(cu, kernels_fatbin(build("graph")))
    k = c_void_p()
    assert cu.cuLibraryGetKernel(byref(k), lib, b"scale_shift") == 0
    before, v = trips(), c_int()
    values = {}
    for attr in range(10):                          # what cudart_code.c's cudaFuncGetAttributes reads
        assert cu.cuKernelGetAttribute(byref(v), attr, k, 0) == 0
        values[attr] = v.value
    assert trips() == before + 1
    assert values[0] == 1024 and values[4] == 32    # the fake's MAX_THREADS_PER_BLOCK and NUM_REGS
    assert cu.cuKernelSetAttribute(8, 50000, k, 0) == 0          # a set forgets only its own attribute
    before = trips()
    assert cu.cuKernelGetAttribute(byref(v), 8, k, 0) == 0 and v.value == 50000
    assert cu.cuKernelGetAttribute(byref(v), 4, k, 0) == 0 and v.value == 32
    assert trips() == before + 1
    assert cu.cuLibraryUnload(lib) == 0


def test_a_lazy_library_loads_at_its_first_use_and_an_unused_one_never(cu, monkeypatch):
    from rgpu.cuda_intercept import client
    from rgpu.cuda_intercept.calls_code import IMAGES
    monkeypatch.setenv("RGPU_CUDA_LAZY_LIBRARIES", "1")
    stats = client.get().conn.stats
    before, loads = dict(stats), IMAGES["loads"]
    used, unused = load(cu, kernels_fatbin(build("graph"))), load(cu, kernels_fatbin(build("streams")))
    assert stats["messages"] == before["messages"] and IMAGES["loads"] == loads     # nothing crossed
    k = c_void_p()
    assert cu.cuLibraryGetKernel(byref(k), used, b"saxpy") == 0
    assert 1 <= stats["round_trips"] - before["round_trips"] <= 2 and IMAGES["loads"] == loads + 1
    lib_back = c_void_p()
    assert cu.cuKernelGetLibrary(byref(lib_back), k) == 0 and lib_back.value == used.value
    saxpy_values(cu, k)
    mid = dict(stats)
    assert cu.cuLibraryUnload(unused) == 0                      # never loaded: nothing to tell the server
    assert stats["messages"] == mid["messages"] and IMAGES["loads"] == loads + 1
    assert cu.cuLibraryUnload(used) == 0
    assert stats["messages"] > mid["messages"]                  # its unload is posted (after the queued frees)
    assert cu.cuLibraryGetKernel(byref(k), unused, b"scale_shift") != 0     # unloaded: a handle no one knows


# ---- nvcc's static runtime: the waits of a program's first launch, counted by the server -----------------
EXTRA = 'extern "C" __global__ void unused{i}(float *x, int n) {{ if ((int)threadIdx.x < n) x[threadIdx.x] += {i}; }}\n'


@pytest.fixture(scope="module")
def counting_server(tmp_path_factory):
    from conftest import RunningServer
    server = RunningServer(tmp_path_factory.mktemp("first-use-server"), ("--cuda-driver", "fake"),
                           env={"RGPU_CUDA_WAIT_REPORT": "1"})
    yield server
    server.stop()


def waits_of_next_session(server, run_it) -> dict:
    import time
    seen = server.stderr.count("answered")
    run_it()
    deadline = time.monotonic() + 10
    while server.stderr.count("answered") == seen and time.monotonic() < deadline:
        time.sleep(0.05)
    line = [x for x in server.stderr.splitlines() if "a cuda session answered" in x][-1]
    return {name: int(n) for name, n in re.findall(r"(\w+) (\d+)", line.split("the most:")[1])}


@pytest.fixture(scope="module")
def four_images(tmp_path_factory):
    """tests/cuda_programs/saxpy.cu on the static runtime with three more translation units: four images."""
    import subprocess
    from cuda_programs import HERE, nvcc_or_skip
    from test_cuda_static_runtime import STATIC_PTX
    from test_cuda_support import build_shim_or_skip
    build_shim_or_skip()
    compiler = nvcc_or_skip()
    out = tmp_path_factory.mktemp("four-images")
    extras = []
    for i in (1, 2, 3):
        extras.append(out / f"extra{i}.cu")
        extras[-1].write_text(EXTRA.format(i=i))
    exe = out / "saxpy-four"
    done = subprocess.run([compiler, *STATIC_PTX, f"-I{HERE}", "-o", str(exe), str(HERE / "saxpy.cu"),
                           *map(str, extras)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return exe


@pytest.mark.parametrize("lazy", ["0", "1"])
def test_a_static_runtime_program_of_four_images_loads_one_when_lazy(lazy, counting_server, four_images):
    from test_cuda_programs import run
    result = []
    waits = waits_of_next_session(counting_server, lambda: result.append(
        run([four_images], counting_server, env={"RGPU_CUDA_LAZY_LIBRARIES": lazy})))
    assert result[0].returncode == 0, result[0].stdout[-2000:] + result[0].stderr
    check("saxpy", result[0].stdout)
    loads = waits.get("image_load", 0)
    assert (1 <= loads <= 2) if lazy == "1" else (4 <= loads <= 8), waits    # a load, and its upload if new
    # loaded before the runtime has a context (eager), the launched kernel's layout is read in it: one trip
    assert waits.get("library_get_kernel_layout", 0) == (0 if lazy == "1" else 1), waits
    assert not {"kernel_get_attribute", "func_get_attribute"} & set(waits), waits


def test_the_servers_report_names_the_records_it_ran_in_python(counting_server, four_images):
    """RGPU_CUDA_WAIT_REPORT on the server also says the time its batches of queued records took and which
    records ran in Python (the fake driver has no C walker: the program's launch is among them)."""
    from test_cuda_programs import run
    seen = counting_server.stderr.count("batches of queued records")
    done = run([four_images], counting_server, env={"RGPU_CUDA_LAZY_LIBRARIES": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    import time
    deadline = time.monotonic() + 10
    while counting_server.stderr.count("batches of queued records") == seen and time.monotonic() < deadline:
        time.sleep(0.05)
    line = [x for x in counting_server.stderr.splitlines() if "batches of queued records" in x][-1]
    found = re.search(r"(\d+) batches of queued records took ([\d.]+) ms on the server; (\d+) records ran in "
                      r"Python, the most: (.*)", line)
    assert found, line
    batches, seconds, slow = int(found[1]), float(found[2]), int(found[3])
    by_name = {name: int(n) for name, n in re.findall(r"(\w+) (\d+)", found[4])}
    assert batches >= 1 and seconds > 0 and by_name.get("cuLaunchKernel", 0) >= 1, line
    assert slow == sum(by_name.values()), line
