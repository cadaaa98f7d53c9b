"""Module images by content: the server's store, the route's image_load, and nvcc's fatbins loaded on the fake driver."""
from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from ctypes import byref, c_float, c_int, c_size_t, c_uint, c_uint64, c_void_p

import numpy as np
import pytest

from cuda_programs import build, kernels_fatbin
from rgpu import config
from rgpu.server.cuda.base import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_BINARY_FOR_GPU, CudaDriverError
from rgpu.server.cuda.fake import FakeDriver
from rgpu.server.cuda.images import ImageStore
from rgpu.server.route import Session
from rgpu.server.cuda.executor import Executor

u64 = c_uint64


@pytest.fixture
def drv():
    d = FakeDriver()
    d.set_current(d.primary_ctx_retain(0))
    return d


def put(d, arr: np.ndarray) -> int:
    p = d.mem_alloc(arr.nbytes)
    d.memcpy_htod(p, None, memoryview(arr.tobytes()))
    return p


def get(d, p: int, n: int, dtype=np.float32) -> np.ndarray:
    return np.frombuffer(bytes(d.memcpy_dtoh(p, n * np.dtype(dtype).itemsize, None)), dtype)


def args(*values: tuple[str, object]) -> bytes:
    """Packed kernel arguments, each at its natural alignment (the CUDA ABI)."""
    out = bytearray()
    for fmt, v in values:
        size = struct.calcsize(fmt)
        out += bytes(-len(out) % size) + struct.pack("<" + fmt, v)
    return bytes(out)


# ---- nvcc's fatbins on the fake --------------------------------------------------------------------
def test_a_ptx_fatbin_loads_as_a_library_whose_kernel_handles_launch(drv):
    lib = drv.library_load({}, kernels_fatbin(build("saxpy")))
    k = drv.library_get_kernel(lib, "saxpy")
    assert drv.kernel_get_function(k) == k
    x, y = np.arange(100, dtype=np.float32), np.ones(100, np.float32)
    dx, dy = put(drv, x), put(drv, y)
    drv.launch(k, (1, 1, 1), (128, 1, 1), 0, 0, None, args(("f", 3.0), ("Q", dx), ("Q", dy), ("i", 100)))
    assert np.array_equal(get(drv, dy, 100), 3 * x + y)


def test_a_constant_symbol_is_a_library_global_the_kernel_reads(drv):
    lib = drv.library_load({}, kernels_fatbin(build("constant")))
    ptr, size = drv.library_get_global(lib, "coeffs")
    assert size == 16
    drv.memcpy_htod(ptr, None, memoryview(np.array([1, 2, 0, 0], np.float32).tobytes()))
    x = np.linspace(-1, 1, 50, dtype=np.float32)
    dx, dy = put(drv, x), drv.mem_alloc(200)
    drv.launch(drv.library_get_kernel(lib, "poly3"), (1, 1, 1), (64, 1, 1), 0, 0, None,
               args(("Q", dx), ("Q", dy), ("i", 50)))
    assert np.allclose(get(drv, dy, 50), 1 + 2 * x)


def test_the_reduction_sums_per_block_by_the_launch_shape_and_needs_its_shared_memory(drv):
    lib = drv.library_load({}, kernels_fatbin(build("reduce")))
    k = drv.library_get_kernel(lib, "block_sum")
    x = np.arange(1000, dtype=np.float32)
    dx, dout = put(drv, x), drv.mem_alloc(16)
    drv.launch(k, (4, 1, 1), (256, 1, 1), 1024, 0, None, args(("Q", dx), ("Q", dout), ("i", 1000)))
    assert np.array_equal(get(drv, dout, 4), np.pad(x, (0, 24)).reshape(4, 256).sum(axis=1))
    with pytest.raises(CudaDriverError, match="shared memory"):
        drv.launch(k, (4, 1, 1), (256, 1, 1), 0, 0, None, args(("Q", dx), ("Q", dout), ("i", 1000)))


def test_a_fatbin_the_fake_cannot_read_fails_saying_why(drv):
    with pytest.raises(CudaDriverError, match="no PTX") as cubin_only:
        drv.library_load({}, kernels_fatbin(build("saxpy", "sm_90")))
    assert cubin_only.value.code == CUDA_ERROR_NO_BINARY_FOR_GPU
    with pytest.raises(CudaDriverError, match="compressed"):
        drv.module_load({}, kernels_fatbin(build("saxpy", "multi")))
    with pytest.raises(CudaDriverError, match="unreadable fatbin"):
        drv.module_load({}, kernels_fatbin(build("saxpy"))[:-8])


# ---- the store ---------------------------------------------------------------------------------------
def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_store_is_shared_through_its_folder_and_bounded(tmp_path):
    a, b, c = (bytes([i]) * 1000 for i in range(3))
    one = ImageStore(tmp_path, limit=2500)
    one.put(sha(a), a)
    assert ImageStore(tmp_path, 2500).get(sha(a)) == a          # another process sees it
    os.utime(tmp_path / sha(a), (1, 1))                         # the least recently used
    one.put(sha(b), b)
    one.put(sha(c), c)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([sha(b), sha(c)])
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_a_damaged_file_or_a_strange_name_is_never_served(tmp_path):
    data = b"x" * 100
    (tmp_path / sha(data)).write_bytes(b"y" * 100)
    store = ImageStore(tmp_path, 1 << 20)
    assert store.get(sha(data)) is None and not (tmp_path / sha(data)).exists()
    assert store.get("../../etc/passwd") is None and store.get(sha(data).upper()) is None


# ---- the route's image_load ---------------------------------------------------------------------------
@pytest.fixture
def route(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made = []

    def make():
        ex = Executor(Session("t", "cuda", config.settings(cuda_driver="fake")))
        made.append(ex)
        ctx = ex.handle(["primary_ctx_retain", 0, 0], [], True)[0][1]
        return ex, ctx
    yield make
    for ex in made:
        ex.close()


def test_a_new_image_costs_one_extra_round_trip_and_a_known_one_none(route):
    image = kernels_fatbin(build("graph"))
    digest = sha(image)
    ex, ctx = route()
    meta = ["image_load", ctx, "library", {}, digest, len(image)]
    assert ex.handle(meta, [], True)[0][:2] == [0, {"send": True}]
    code, lib, _ = ex.handle(meta, [memoryview(image)], True)[0]
    assert code == 0 and ex.handle(["library_get_kernel", ctx, lib, "scale_shift"], [], True)[0][0] == 0
    other, ctx2 = route()                                   # another session: the image is already there
    code, lib2, _ = other.handle(["image_load", ctx2, "module", {}, digest, len(image)], [], True)[0]
    assert code == 0 and lib2[0]


def test_bytes_that_do_not_match_their_digest_or_a_bad_request_are_an_error_reply(route):
    ex, ctx = route()
    image = kernels_fatbin(build("saxpy"))
    for meta, bufs in ((["image_load", ctx, "library", {}, sha(b"other"), len(image)], [memoryview(image)]),
                       (["image_load", ctx, "library", {}, "../x", 3], []),
                       (["image_load", ctx, "nothing", {}, sha(image), len(image)], []),
                       (["image_load", ctx, "library", {}, sha(image), len(image) + 1], [memoryview(image)])):
        code, message, _ = ex.handle(meta, bufs, True)[0]
        assert code == CUDA_ERROR_INVALID_VALUE, message


# ---- through rgpu's libcuda.so.1 ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cu():
    from test_cuda_support import shim_in_process
    lib = shim_in_process()
    ctx = c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    return lib


class Wrapper(ctypes.Structure):      # __fatBinC_Wrapper_t, as nvcc emits it
    _fields_ = [("magic", c_int), ("version", c_int), ("data", c_void_p), ("filename", c_void_p)]


def test_the_interceptor_loads_a_fatbin_once_by_content_and_counts_the_bytes(cu):
    from rgpu.cuda_intercept.calls_code import IMAGES
    image = ctypes.create_string_buffer(kernels_fatbin(build("streams")))
    before = dict(IMAGES)
    lib, lib2, mod, k = c_void_p(), c_void_p(), c_void_p(), c_void_p()
    assert cu.cuLibraryLoadData(byref(lib), image, None, None, 0, None, None, 0) == 0
    assert IMAGES["uploads"] - before["uploads"] <= 1
    sent = IMAGES["bytes_uploaded"] - before["bytes_uploaded"]
    assert sent in (0, len(image.raw) - 1)                  # the store may know it from an earlier run
    wrapper = Wrapper(0x466243B1, 1, ctypes.addressof(image), None)
    assert cu.cuModuleLoadFatBinary(byref(mod), byref(wrapper)) == 0
    assert cu.cuLibraryLoadData(byref(lib2), image, None, None, 0, None, None, 0) == 0
    assert IMAGES["bytes_uploaded"] - before["bytes_uploaded"] == sent     # known now: no bytes crossed again
    assert IMAGES["loads"] - before["loads"] == 3
    assert cu.cuLibraryGetKernel(byref(k), lib2, b"scale_shift") == 0
    n = 64
    x = np.arange(n, dtype=np.float32)
    d = u64()
    assert cu.cuMemAlloc_v2(byref(d), c_size_t(4 * n)) == 0
    assert cu.cuMemcpyHtoD_v2(d, x.ctypes.data_as(c_void_p), c_size_t(4 * n)) == 0
    a, b, cnt = c_float(2), c_float(1), c_int(n)
    params = (c_void_p * 4)(*[ctypes.cast(byref(v), c_void_p) for v in (d, a, b, cnt)])
    assert cu.cuLaunchKernel(k, c_uint(1), 1, 1, c_uint(64), 1, 1, 0, None, params, None) == 0
    out = np.empty_like(x)
    assert cu.cuMemcpyDtoH_v2(out.ctypes.data_as(c_void_p), d, c_size_t(4 * n)) == 0
    assert np.array_equal(out, 2 * x + 1)


def test_the_real_driver_is_never_handed_an_image_whose_lengths_lie():
    from rgpu.server.cuda.images import image_problem
    good = kernels_fatbin(build("saxpy"))
    assert image_problem(good) is None and image_problem(b".version 8.0\0") is None
    assert "malformed fatbin" in image_problem(good[:-16])
    assert "NUL" in image_problem(b".version 8.0\n.target sm_90")
    elf = bytearray(b"\x7fELF" + bytes(60))
    struct.pack_into("<Q", elf, 0x28, 1 << 40)          # section headers a terabyte away
    struct.pack_into("<HH", elf, 0x3A, 64, 3)
    assert "past its end" in image_problem(bytes(elf))
    assert "wrapper" in image_problem(struct.pack("<IIQQ", 0x466243B1, 1, 0x1000, 0))


def test_the_interceptor_sends_only_the_cubin_of_the_servers_gpu(cu):
    from rgpu.cuda_intercept.calls_code import IMAGES
    from rgpu import fatbin
    image = kernels_fatbin(build("graph", "multi"))                 # sm_80, sm_90, sm_100 and compute_90
    before = dict(IMAGES)
    lib = c_void_p()
    rc = cu.cuLibraryLoadData(byref(lib), ctypes.c_char_p(image), None, None, 0, None, None, 0)
    assert rc == CUDA_ERROR_NO_BINARY_FOR_GPU                         # the fake (a 9.0 device) runs PTX only
    assert IMAGES["bytes_before_trim"] - before["bytes_before_trim"] == len(image)
    sent = IMAGES["bytes_after_trim"] - before["bytes_after_trim"]
    sm90 = [e for e in fatbin.entries(image) if e.name() == "sm_90"][0]
    assert sent == 16 + sm90.header_size + sm90.size


def test_a_kernel_look_up_and_its_layout_cost_one_round_trip(cu):
    from rgpu.cuda_intercept import client
    lib, k = c_void_p(), c_void_p()
    assert cu.cuLibraryLoadData(byref(lib), ctypes.c_char_p(kernels_fatbin(build("graph"))), None, None, 0,
                                None, None, 0) == 0
    stats = client.get().conn.stats
    before = stats["round_trips"]
    assert cu.cuLibraryGetKernel(byref(k), lib, b"saxpy") == 0
    assert stats["round_trips"] - before <= 1          # none now: the library's load carried every layout
    offset, size = c_size_t(), c_size_t()
    assert cu.cuKernelGetParamInfo(k, 3, byref(offset), byref(size)) == 0 and (offset.value, size.value) == (24, 4)


@pytest.mark.parametrize("cut", [16, 40, 95, 200])
def test_a_cut_or_damaged_fatbin_is_an_error_reply_never_a_crash(route, cut):
    from hypothesis import given, settings, strategies as st
    image = kernels_fatbin(build("saxpy"))
    ex, ctx = route()

    @settings(max_examples=40, deadline=None)
    @given(st.binary(min_size=1, max_size=64), st.integers(0, 4096))
    def damaged(junk, at):
        bad = bytearray(image[:cut] + junk + image[cut:])
        bad[at % len(bad)] ^= 0xFF
        bad = bytes(bad)
        code, _, _ = ex.handle(["image_load", ctx, "library", {}, sha(bad), len(bad)], [memoryview(bad)], True)[0]
        assert code in (0, 200, 209, 218, 1)         # loaded, or INVALID_IMAGE / NO_BINARY / INVALID_PTX / VALUE
    damaged()
