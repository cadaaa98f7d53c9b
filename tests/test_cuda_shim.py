"""rgpu's libcuda.so.1 loaded in this process: C answers, Python forwarding, the executor on the fake driver.

The shim is loaded once with ctypes; its Python side runs in this interpreter
and talks to a cuda-route executor through an in-process loopback, so every
test here runs the real C and Python paths without a server process.
"""
from __future__ import annotations

import ctypes
import logging
import re
from ctypes import byref, c_int, c_size_t, c_uint, c_uint64, c_void_p

import numpy as np
import pytest

from test_cuda_support import VECADD_C, shim_in_process

u64 = c_uint64


@pytest.fixture(scope="module")
def cu():
    lib = shim_in_process()
    ctx = c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    lib.ctx = ctx
    return lib


def ptx() -> bytes:
    """The PTX embedded in the C test program (vecAdd, saxpy, noop)."""
    src = VECADD_C.read_text()
    body = src[src.index("static const char *PTX ="):src.index(";\n", src.index("static const char *PTX ="))]
    return "".join(eval(s) for s in re.findall(r'^\s*(".*")\s*$', body, re.M)).encode() + b"\0"


@pytest.fixture(scope="module")
def kernels(cu):
    mod = c_void_p()
    assert cu.cuModuleLoadData(byref(mod), ctypes.c_char_p(ptx())) == 0
    out = {}
    for name in ("vecAdd", "saxpy", "noop"):
        f = c_void_p()
        assert cu.cuModuleGetFunction(byref(f), mod, name.encode()) == 0
        out[name] = f
    return out


def alloc(cu, nbytes: int) -> int:
    d = u64()
    assert cu.cuMemAlloc_v2(byref(d), c_size_t(nbytes)) == 0
    return d.value


def upload(cu, arr: np.ndarray) -> int:
    d = alloc(cu, arr.nbytes)
    assert cu.cuMemcpyHtoD_v2(u64(d), arr.ctypes.data_as(c_void_p), c_size_t(arr.nbytes)) == 0
    return d


def download(cu, d: int, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    assert cu.cuMemcpyDtoH_v2(out.ctypes.data_as(c_void_p), u64(d), c_size_t(out.nbytes)) == 0
    return out


def launch(cu, f, n, *args, stream=None, block=128):
    params = (c_void_p * len(args))(*[ctypes.cast(byref(a), c_void_p) for a in args])
    return cu.cuLaunchKernel(f, c_uint((n + block - 1) // block), 1, 1, c_uint(block), 1, 1, 0, stream, params, None)


def test_every_driver_entry_point_is_exported(cu):
    from rgpu.cuda_intercept import header, model
    api = model.parse(header.load())
    missing = [n for n in api.functions if not hasattr(cu, n)]
    assert missing == []


def test_error_names_and_strings_are_answered_in_c(cu):
    p = ctypes.c_char_p()
    assert cu.cuGetErrorName(801, byref(p)) == 0 and p.value == b"CUDA_ERROR_NOT_SUPPORTED"
    assert cu.cuGetErrorString(2, byref(p)) == 0 and b"memory" in p.value
    assert cu.cuGetErrorName(123456, byref(p)) == 1


def test_cuGetProcAddress_hands_back_the_versioned_export(cu):
    fn, status = c_void_p(), c_int()
    assert cu.cuGetProcAddress_v2(b"cuMemAlloc", byref(fn), 12000, u64(0), byref(status)) == 0
    assert fn.value == ctypes.cast(cu.cuMemAlloc_v2, c_void_p).value and status.value == 0
    assert cu.cuGetProcAddress_v2(b"cuMemcpyHtoD", byref(fn), 12000, u64(2), byref(status)) == 0
    assert fn.value == ctypes.cast(cu.cuMemcpyHtoD_v2_ptds, c_void_p).value
    assert cu.cuGetProcAddress_v2(b"cuLaunchKernelEx", byref(fn), 11000, u64(0), byref(status)) == 500
    assert status.value == 2                 # CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
    assert cu.cuGetProcAddress_v2(b"cuNoSuchThing", byref(fn), 13000, u64(0), byref(status)) == 500
    assert status.value == 1


def test_device_queries_after_cuInit_match_the_server(cu):
    n, v = c_int(), c_int()
    assert cu.cuDeviceGetCount(byref(n)) == 0 and n.value == 1
    assert cu.cuDeviceGetAttribute(byref(v), 1, 0) == 0 and v.value == 1024     # MAX_THREADS_PER_BLOCK
    assert cu.cuDeviceGetAttribute(byref(v), 19, 0) == 0 and v.value == 0       # CAN_MAP_HOST_MEMORY: never here
    assert cu.cuDeviceGetAttribute(byref(v), 1, 5) == 101
    name = ctypes.create_string_buffer(64)
    assert cu.cuDeviceGetName(name, 64, 0) == 0 and name.value == b"rgpu fake device"
    major, minor = c_int(), c_int()
    assert cu.cuDeviceComputeCapability(byref(major), byref(minor), 0) == 0 and major.value == 9


def test_the_context_stack_is_kept_per_thread_in_c(cu):
    cur, dev = c_void_p(), c_int()
    assert cu.cuCtxGetCurrent(byref(cur)) == 0 and cur.value == cu.ctx.value
    created = c_void_p()
    assert cu.cuCtxCreate_v2(byref(created), 0, 0) == 0
    assert cu.cuCtxGetCurrent(byref(cur)) == 0 and cur.value == created.value
    assert cu.cuCtxGetDevice(byref(dev)) == 0 and dev.value == 0
    popped = c_void_p()
    assert cu.cuCtxPopCurrent_v2(byref(popped)) == 0 and popped.value == created.value
    assert cu.cuCtxGetCurrent(byref(cur)) == 0 and cur.value == cu.ctx.value
    assert cu.cuCtxDestroy_v2(created) == 0
    assert cu.cuCtxPushCurrent_v2(created) == 201        # destroyed: CUDA_ERROR_INVALID_CONTEXT


def test_copies_round_trip_through_device_memory(cu):
    a = np.arange(4096, dtype=np.float32)
    d = upload(cu, a)
    assert np.array_equal(download(cu, d, a), a)
    assert cu.cuMemsetD32_v2(u64(d), c_uint(0x3F800000), c_size_t(16)) == 0     # 1.0f
    got = download(cu, d, a)
    assert np.all(got[:16] == 1.0) and np.array_equal(got[16:], a[16:])
    assert cu.cuMemFree_v2(u64(d)) == 0


def test_a_launch_with_kernelParams_is_queued_in_c_and_computes(cu, kernels):
    n = 1000
    a, b = np.arange(n, dtype=np.float32), np.full(n, 2, np.float32)
    da, db, dc = upload(cu, a), upload(cu, b), alloc(cu, 4 * n)
    from rgpu.cuda_intercept import client
    before = client.get().conn.stats["round_trips"]
    assert launch(cu, kernels["vecAdd"], n, u64(da), u64(db), u64(dc), c_int(n)) == 0
    assert client.get().conn.stats["round_trips"] == before          # nothing waited for
    assert np.array_equal(download(cu, dc, a), a + b)


def test_a_launch_through_extra_packs_the_callers_buffer(cu, kernels):
    n = 256
    x = np.ones(n, np.float32)
    dx, dy = upload(cu, x), upload(cu, np.zeros(n, np.float32))
    raw = np.float32(3).tobytes() + bytes(4) + np.uint64(dx).tobytes() + np.uint64(dy).tobytes() + np.int32(n).tobytes()
    packed = ctypes.create_string_buffer(raw, 28)
    size = c_size_t(28)
    extra = (c_void_p * 5)(1, ctypes.addressof(packed), 2, ctypes.addressof(size), 0)
    assert cu.cuLaunchKernel(kernels["saxpy"], 2, 1, 1, 128, 1, 1, 0, None, None, extra) == 0
    assert np.all(download(cu, dy, x) == 3.0)


def test_a_launch_whose_arguments_do_not_fit_the_layout_is_refused_clearly(cu, kernels, caplog):
    size = c_size_t(12)
    packed = ctypes.create_string_buffer(12)
    extra = (c_void_p * 5)(1, ctypes.addressof(packed), 2, ctypes.addressof(size), 0)
    with caplog.at_level(logging.WARNING, logger="rgpu.cuda"):
        assert cu.cuLaunchKernel(kernels["saxpy"], 1, 1, 1, 32, 1, 1, 0, None, None, extra) == 1
    assert "takes 28 bytes of arguments" in caplog.text and "extra gives 12" in caplog.text


def test_a_failed_queued_call_is_reported_at_the_next_synchronisation(cu, kernels, caplog):
    bogus = u64(0xDEAD0000)
    with caplog.at_level(logging.WARNING, logger="rgpu.cuda"):
        assert launch(cu, kernels["vecAdd"], 64, bogus, bogus, bogus, c_int(64)) == 0   # queued
        assert cu.cuCtxSynchronize() == 700                                             # ILLEGAL_ADDRESS
    assert "cuLaunchKernel failed on the server" in caplog.text
    assert cu.cuCtxSynchronize() == 0


def test_stream_capture_records_a_graph_that_replays_in_one_post(cu, kernels):
    n = 128
    dx, dy = upload(cu, np.ones(n, np.float32)), upload(cu, np.zeros(n, np.float32))
    s, g, ge, status = c_void_p(), c_void_p(), c_void_p(), c_int()
    assert cu.cuStreamCreate(byref(s), 1) == 0
    assert cu.cuStreamBeginCapture_v2(s, 0) == 0
    assert cu.cuStreamIsCapturing(s, byref(status)) == 0 and status.value == 1
    assert launch(cu, kernels["saxpy"], n, ctypes.c_float(2), u64(dx), u64(dy), c_int(n), stream=s) == 0
    assert cu.cuStreamEndCapture(s, byref(g)) == 0
    assert cu.cuGraphInstantiateWithFlags(byref(ge), g, u64(0)) == 0
    assert np.all(download(cu, dy, np.zeros(n, np.float32)) == 0)      # captured, not run
    from rgpu.cuda_intercept import client
    before = client.get().conn.stats["round_trips"]
    for _ in range(3):
        assert cu.cuGraphLaunch(ge, s) == 0
    assert cu.cuStreamSynchronize(s) == 0
    assert client.get().conn.stats["round_trips"] == before + 1          # three replays, one wait
    assert np.all(download(cu, dy, np.zeros(n, np.float32)) == 6.0)


def test_events_time_and_order_work_on_streams(cu):
    e0, e1, s, ms = c_void_p(), c_void_p(), c_void_p(), ctypes.c_float()
    assert cu.cuEventCreate(byref(e0), 0) == 0 and cu.cuEventCreate(byref(e1), 0) == 0
    assert cu.cuStreamCreate(byref(s), 0) == 0
    assert cu.cuEventRecord(e0, s) == 0 and cu.cuEventRecord(e1, s) == 0
    assert cu.cuStreamWaitEvent(None, e1, 0) == 0
    assert cu.cuEventSynchronize(e1) == 0
    assert cu.cuEventElapsedTime(byref(ms), e0, e1) == 0 and ms.value >= 0
    assert cu.cuEventDestroy_v2(e0) == 0 and cu.cuStreamDestroy_v2(s) == 0


def test_pointer_attributes_of_our_allocations_are_exact(cu):
    d = alloc(cu, 1000)
    kind, base, size, ctx = c_uint(), u64(), c_size_t(), c_void_p()
    assert cu.cuPointerGetAttribute(byref(kind), 2, u64(d + 10)) == 0 and kind.value == 2      # DEVICE
    assert cu.cuPointerGetAttribute(byref(base), 11, u64(d + 10)) == 0 and base.value == d
    assert cu.cuPointerGetAttribute(byref(size), 12, u64(d + 10)) == 0 and size.value == 1000
    assert cu.cuPointerGetAttribute(byref(ctx), 1, u64(d)) == 0 and ctx.value == cu.ctx.value
    host = np.zeros(4)
    assert cu.cuPointerGetAttribute(byref(kind), 2, u64(host.ctypes.data)) == 1                # not ours
    assert cu.cuMemGetAddressRange_v2(byref(base), byref(size), u64(d + 999)) == 0 and base.value == d


def test_managed_and_mapped_host_memory_are_refused_with_the_reason(cu, caplog):
    d, p = u64(), c_void_p()
    with caplog.at_level(logging.WARNING, logger="rgpu.cuda"):
        assert cu.cuMemAllocManaged(byref(d), c_size_t(64), 1) == 801
        assert cu.cuMemHostAlloc(byref(p), c_size_t(64), 0x02) == 801                # DEVICEMAP
    assert "managed memory cannot be shared" in caplog.text and "mapped host memory" in caplog.text
    assert cu.cuMemHostAlloc(byref(p), c_size_t(64), 0) == 0                         # plain pinned: fine
    assert p.value % 4096 == 0 and cu.cuMemFreeHost(p) == 0


def test_an_entry_point_not_implemented_says_so_once_and_returns_not_supported(cu, caplog):
    with caplog.at_level(logging.WARNING, logger="rgpu.cuda"):
        assert cu.cuArray3DCreate_v2(None, None) == 801
        assert cu.cuArray3DCreate_v2(None, None) == 801
    assert caplog.text.count("cuArray3DCreate_v2 is not implemented") == 1


def test_link_then_load_the_linked_image_as_numba_cuda_does(cu):
    state, cubin, size, mod, f = c_void_p(), c_void_p(), c_size_t(), c_void_p(), c_void_p()
    assert cu.cuLinkCreate_v2(0, None, None, byref(state)) == 0
    image = ptx()
    assert cu.cuLinkAddData_v2(state, 1, ctypes.c_char_p(image), c_size_t(len(image)), b"k.ptx", 0, None, None) == 0
    assert cu.cuLinkComplete(state, byref(cubin), byref(size)) == 0 and size.value > 0
    assert cu.cuModuleLoadData(byref(mod), cubin) == 0
    assert cu.cuModuleGetFunction(byref(f), mod, b"noop") == 0
    assert cu.cuLinkDestroy(state) == 0
    offset, psize = c_size_t(), c_size_t()
    assert cu.cuFuncGetParamInfo(f, 0, byref(offset), byref(psize)) == 1          # noop takes nothing


def test_the_library_api_loads_kernels_that_launch(cu):
    lib, k, f = c_void_p(), c_void_p(), c_void_p()
    assert cu.cuLibraryLoadData(byref(lib), ctypes.c_char_p(ptx()), None, None, 0, None, None, 0) == 0
    assert cu.cuLibraryGetKernel(byref(k), lib, b"vecAdd") == 0
    assert cu.cuKernelGetFunction(byref(f), k) == 0
    offset, size = c_size_t(), c_size_t()
    assert cu.cuKernelGetParamInfo(k, 3, byref(offset), byref(size)) == 0 and (offset.value, size.value) == (24, 4)
    n = 32
    a = np.arange(n, dtype=np.float32)
    da, dc = upload(cu, a), alloc(cu, 4 * n)
    assert launch(cu, k, n, u64(da), u64(da), u64(dc), c_int(n)) == 0         # a CUkernel launches as a function
    assert np.array_equal(download(cu, dc, a), 2 * a)


def test_launches_beyond_the_c_queue_limit_are_posted_in_several_batches(cu, kernels):
    from rgpu.cuda_intercept import client
    conn = client.get().conn
    posts, trips = conn.stats["posts"], conn.stats["round_trips"]
    for _ in range(5000):                       # 64-byte records: the default 64 KiB fills at 1024
        assert cu.cuLaunchKernel(kernels["noop"], 1, 1, 1, 32, 1, 1, 0, None, None, None) == 0
    assert cu.cuCtxSynchronize() == 0
    assert conn.stats["posts"] - posts >= 2 and conn.stats["round_trips"] == trips + 1


def test_python_is_entered_with_the_garbage_collector_held_off():
    import gc
    from rgpu.cuda_intercept import registry
    seen = []
    registry.IMPLS["_test_gc_probe"] = lambda: seen.append(gc.isenabled()) or 0
    try:
        assert registry.handler("_test_gc_probe")() == 0
    finally:
        del registry.IMPLS["_test_gc_probe"]
    assert seen == [False] and gc.isenabled()


def test_an_exception_inside_an_implementation_is_an_error_code_never_success():
    from rgpu.cuda_intercept import registry
    registry.IMPLS["_test_boom"] = lambda: 1 / 0
    try:
        assert registry.handler("_test_boom")() == 999           # CUDA_ERROR_UNKNOWN, traceback logged
    finally:
        del registry.IMPLS["_test_boom"]


def test_the_coverage_page_is_what_the_generator_writes():
    from pathlib import Path
    from rgpu.cuda_intercept.coverage import markdown
    page = Path(__file__).resolve().parent.parent / "docs" / "cuda_coverage.md"
    assert page.read_text() == markdown(), "run: rgpu intercept coverage --out docs/cuda_coverage.md"


def test_every_queued_or_synchronising_call_has_an_implementation():
    from rgpu.cuda_intercept.annotations import QUEUED, SYNCHRONISING, base_of
    from rgpu.cuda_intercept.registry import IMPLS
    implemented = {base_of(n) for n in IMPLS}
    assert (QUEUED | SYNCHRONISING) - implemented == set()


def test_threads_keep_their_own_current_context_and_their_results(cu, kernels):
    import threading
    errors, n = [], 4096

    def work(k):
        try:
            own = c_void_p()
            assert cu.cuCtxSetCurrent(cu.ctx) == 0          # a new thread starts with no context
            assert cu.cuCtxCreate_v2(byref(own), 0, 0) == 0
            cur = c_void_p()
            assert cu.cuCtxGetCurrent(byref(cur)) == 0 and cur.value == own.value
            assert cu.cuCtxSetCurrent(cu.ctx) == 0          # kernels were loaded in the primary context
            a = np.full(n, k, np.float32)
            for _ in range(20):
                da, dc = upload(cu, a), alloc(cu, 4 * n)
                assert launch(cu, kernels["vecAdd"], n, u64(da), u64(da), u64(dc), c_int(n)) == 0
                assert np.all(download(cu, dc, a) == 2 * k)
                assert cu.cuMemFree_v2(u64(da)) == 0 and cu.cuMemFree_v2(u64(dc)) == 0
            assert cu.cuCtxDestroy_v2(own) == 0
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_copy_bigger_than_one_piece_travels_in_several_and_arrives_whole(cu, monkeypatch):
    from rgpu.cuda_intercept import calls_memory
    monkeypatch.setattr(calls_memory, "CHUNK", 4096)          # downloads
    monkeypatch.setattr(calls_memory, "HTOD_PIECE", 3000)     # uploads (a last piece shorter than the rest)
    a = np.random.default_rng(1).integers(0, 255, 10000, dtype=np.uint8)
    d = upload(cu, a)
    assert np.array_equal(download(cu, d, a), a)
    assert cu.cuMemFree_v2(u64(d)) == 0


QUEUE_PROBE = """
import ctypes, sys
from ctypes import byref, c_void_p
sys.path.insert(0, {tests!r})
import test_cuda_shim as t
from test_cuda_support import shim_in_process
from rgpu.cuda_intercept import client
cu = shim_in_process()
ctx = c_void_p()
assert cu.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
mod, f = c_void_p(), c_void_p()
assert cu.cuModuleLoadData(byref(mod), ctypes.c_char_p(t.ptx())) == 0
assert cu.cuModuleGetFunction(byref(f), mod, b"noop") == 0
conn = client.get().conn
for step in range(2):                           # the wait between the two restarts the first post's size
    posts = conn.stats["posts"]
    for _ in range(500):                        # 64-byte records: 32,000 bytes in all
        assert cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, None, None, None) == 0
    assert cu.cuCtxSynchronize() == 0
    print("posts", conn.stats["posts"] - posts)
"""


# (RGPU_CUDA_QUEUE_FIRST_BYTES, RGPU_CUDA_QUEUE_BYTES): the posts of a step of 32,000 bytes, its wait's included
@pytest.mark.parametrize("first,limit,posts", [
    (None, None, 1),        # the default: a fixed 64 KiB, past the step's, so only the wait's post
    ("16K", None, 2),       # 16 KiB, then the rest at the wait (the next post would have been at 32 KiB)
    ("4K", None, 4),        # at 4 KiB, 8 KiB more and 16 KiB more, then the rest at the wait
    ("16K", "4K", 8),       # the first size is at most the limit: every 4 KiB, then the rest
    (None, "4K", 8),        # unset: the limit's
])
def test_the_queue_is_posted_first_small_then_at_twice_the_size_up_to_rgpu_cuda_queue_bytes(cu, first, limit, posts):
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k not in ("RGPU_CUDA_QUEUE_BYTES", "RGPU_CUDA_QUEUE_FIRST_BYTES")}
    if limit:
        env["RGPU_CUDA_QUEUE_BYTES"] = limit
    if first:
        env["RGPU_CUDA_QUEUE_FIRST_BYTES"] = first
    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", QUEUE_PROBE.format(tests=tests)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    per_step = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("posts")]
    assert per_step == [posts, posts], done.stdout
