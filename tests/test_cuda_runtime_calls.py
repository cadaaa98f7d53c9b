"""What the translated runtime asks of the driver, on the server: capture info, graph nodes, kernel attributes,
stream-ordered pools, cuLaunchKernelEx records, CUkernel launches, fatbins trimmed to the device.

The fake driver runs every test here; the real driver's code runs over rgpu's own
libcuda.so.1 (``over_shim``, forwarding to the fake) where the client side exists,
and on an NVIDIA GPU (``-m gpu``, through the device tool) against the real driver.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest

from cuda_programs import build, kernels_fatbin
from rgpu import config
from rgpu.cuda_intercept.fatbin import trim
from rgpu.server.cuda import open_driver, real, real_api
from rgpu.server.cuda.base import CudaDriverError
from rgpu.server.cuda.fake import FakeDriver
from rgpu.server.route import Session
from rgpu.server.cuda.executor import LAUNCH, LAUNCH_EX_ATTRS, Executor

F32 = np.float32
# CUlaunchAttribute {id = CU_LAUNCH_ATTRIBUTE_PRIORITY (8), pad, value.priority = 0}: 72 bytes
PRIORITY = struct.pack("<I4xi60x", 8, 0)


@pytest.fixture
def drv():
    d = FakeDriver()
    d.set_current(d.primary_ctx_retain(0))
    return d


def saxpy_args(alpha: float, x: int, y: int, n: int) -> bytes:
    return struct.pack("<f4xQQi", alpha, x, y, n)


def floats(d, p: int, n: int) -> np.ndarray:
    return np.frombuffer(bytes(d.memcpy_dtoh(p, 4 * n, None)), F32)


def filled(d, n: int, value: float) -> int:
    p = d.mem_alloc(4 * n)
    d.memcpy_htod(p, None, memoryview(np.full(n, value, F32).tobytes()))
    return p


def capture_and_replay(d, k):
    """Capture two saxpys on a stream, asking the capture state between them; replay the graph 3 times."""
    n = 64
    x, y = filled(d, n, 1.0), filled(d, n, 0.0)
    s = d.stream_create(1, 0)
    assert d.stream_get_capture_info(s)[0] == 0
    d.stream_begin_capture(s, 0)
    d.launch(k, (1, 1, 1), (n, 1, 1), 0, s, None, saxpy_args(1.0, x, y, n))
    status, cid, graph, deps = d.stream_get_capture_info(s)
    assert status == 1 and cid and graph and len(deps) == 1
    d.launch(k, (1, 1, 1), (n, 1, 1), 0, s, None, saxpy_args(2.0, x, y, n))
    g = d.stream_end_capture(s)
    nodes = d.graph_get_nodes(g)
    assert len(nodes) == 2 and deps[0] in nodes and d.graph_get_nodes(g) == nodes
    exe = d.graph_instantiate(g, 0)
    for _ in range(3):
        d.graph_launch(exe, s)
    d.stream_synchronize(s)
    assert np.all(floats(d, y, n) == 9.0)
    d.graph_exec_destroy(exe)
    d.graph_destroy(g)
    d.stream_destroy(s)


def pools(d, dev: int = 0):
    """The default pool, its attributes, stream-ordered allocations that hold memory and give it back."""
    pool = d.device_get_default_mem_pool(dev)
    assert d.device_get_default_mem_pool(dev) == pool
    d.mem_pool_set_attribute(pool, 4, 1 << 20)                       # RELEASE_THRESHOLD: cuuint64_t
    assert d.mem_pool_get_attribute(pool, 4) == 1 << 20
    d.mem_pool_set_attribute(pool, 2, 0)                              # REUSE_ALLOW_OPPORTUNISTIC: int
    assert d.mem_pool_get_attribute(pool, 2) == 0
    s = d.stream_create(1, 0)
    p = d.mem_alloc_async(4096, s)
    q = d.mem_alloc_async(4096, s, pool)
    d.memset(p, 7, 1, 4096, s)
    assert d.mem_pool_get_attribute(pool, 7) >= 8192                  # USED_MEM_CURRENT
    d.mem_free_async(p, s)
    d.mem_free_async(q, s)
    d.stream_synchronize(s)
    d.mem_pool_trim_to(pool, 0)
    d.stream_destroy(s)


# ---- the fake driver -------------------------------------------------------------------------------
def test_capture_info_and_graph_nodes_follow_a_capture(drv):
    lib = drv.library_load({}, kernels_fatbin(build("graph")))
    capture_and_replay(drv, drv.library_get_kernel(lib, "saxpy"))


def test_stream_ordered_allocations_come_from_a_default_pool_per_device(drv):
    pools(drv)
    with pytest.raises(CudaDriverError):
        drv.mem_pool_set_attribute(drv.device_get_default_mem_pool(0), 7, 0)    # USED_MEM_CURRENT is read-only


def test_kernel_attributes_are_read_and_set_through_the_kernel_handle(drv):
    lib = drv.library_load({}, kernels_fatbin(build("reduce")))
    k = drv.library_get_kernel(lib, "block_sum")
    assert drv.kernel_get_attribute(0, k, 0) == 1024                  # MAX_THREADS_PER_BLOCK
    drv.kernel_set_attribute(8, 100 << 10, k, 0)                      # MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert drv.kernel_get_attribute(8, k, 0) == 100 << 10
    assert drv.func_get_attribute(8, drv.kernel_get_function(k)) == 100 << 10
    assert drv.occupancy_max_active_blocks(k, 256, 1024) >= 1


def ex_record(func: int, ctx: int, args: bytes, attrs=(), n: int = 64) -> bytes:
    """A cuLaunchKernelEx record (kind 2) as the interceptor's C queue lays it out."""
    tail = LAUNCH_EX_ATTRS.pack(len(attrs), 0) + b"".join(attrs) + args
    size = (LAUNCH.size + len(tail) + 7) // 8 * 8
    return LAUNCH.pack(size, 2, func, ctx, 0, 1, 1, 1, n, 1, 1, 0, len(args)) + tail.ljust(size - LAUNCH.size, b"\0")


def plain_record(func: int, ctx: int, args: bytes, n: int = 64) -> bytes:
    size = (LAUNCH.size + len(args) + 7) // 8 * 8
    return LAUNCH.pack(size, 1, func, ctx, 0, 1, 1, 1, n, 1, 1, 0, len(args)) + args.ljust(size - LAUNCH.size, b"\0")


def run_records(ex: Executor, ctx: int, k: int) -> tuple[np.ndarray, list]:
    n = 64
    x, y = filled(ex.driver, n, 1.0), filled(ex.driver, n, 0.0)
    records = (plain_record(k, ctx, saxpy_args(1.0, x, y, n)) + ex_record(k, ctx, saxpy_args(2.0, x, y, n), [PRIORITY])
               + ex_record(k, ctx, saxpy_args(4.0, x, y, n)) + ex_record(k, ctx, saxpy_args(1.0, x, y, n))[:-8])
    try:
        ex.handle(["launches", 0], [memoryview(records)], False)
    except Exception as exc:              # the cut-short record at the end is malformed: the batch says so
        ex.deferred.append(["launches", 1, str(exc)])
    ex.driver.ctx_synchronize()
    return floats(ex.driver, y, n), ex.deferred


def test_cuLaunchKernelEx_records_run_in_order_with_plain_ones_and_a_cut_record_is_refused(drv):
    ex = Executor(Session("t", "cuda", config.settings(environ={}, cuda_driver="fake")))
    ex.driver = drv
    lib = drv.library_load({}, kernels_fatbin(build("saxpy")))
    y, deferred = run_records(ex, drv.current, drv.library_get_kernel(lib, "saxpy"))
    assert np.all(y == 7.0) and len(deferred) == 1 and "malformed" in deferred[0][2]


# ---- the real driver's code over rgpu's own libcuda.so.1 ----------------------------------------------
@pytest.fixture
def over_shim(monkeypatch):
    from test_cuda_support import shim_in_process
    shim = shim_in_process()
    lib = ctypes.CDLL(shim._name)
    monkeypatch.setattr(real, "load", lambda: real_api.typed(lib))
    saved = ctypes.c_void_p()
    shim.cuCtxGetCurrent(ctypes.byref(saved))
    d = real.RealDriver()
    d.init(4)
    d.set_current(d.primary_ctx_retain(0))
    yield d
    d.close()
    shim.cuCtxSetCurrent(saved)


def test_the_real_drivers_pools_and_kernel_attributes_over_the_interceptor(over_shim):
    pools(over_shim)
    lib = over_shim.library_load({}, memoryview(kernels_fatbin(build("reduce"))))
    k = over_shim.library_get_kernel(lib, "block_sum")
    over_shim.kernel_set_attribute(8, 64 << 10, k, 0)
    assert over_shim.kernel_get_attribute(8, k, 0) == 64 << 10


def test_setting_a_kernel_attribute_to_its_value_again_crosses_no_more(over_shim):
    """Kernels with large shared memory set it before every launch (torch's attention): one round trip, not one each."""
    from rgpu.cuda_intercept import client
    lib = over_shim.library_load({}, memoryview(kernels_fatbin(build("reduce"))))
    k = over_shim.library_get_kernel(lib, "block_sum")
    waits = client.get().waits
    before = waits["kernel_set_attribute"]
    for _ in range(3):
        over_shim.kernel_set_attribute(8, 32 << 10, k, 0)
    assert waits["kernel_set_attribute"] == before + 1
    over_shim.kernel_set_attribute(8, 48 << 10, k, 0)            # a new value crosses, and is what the driver has
    assert waits["kernel_set_attribute"] == before + 2 and over_shim.kernel_get_attribute(8, k, 0) == 48 << 10


def test_the_real_drivers_cuLaunchKernelEx_records_over_the_interceptor(over_shim):
    ex = Executor(Session("t", "cuda", config.settings(environ={}, cuda_driver="fake")))
    ex.driver = over_shim
    lib = over_shim.library_load({}, memoryview(kernels_fatbin(build("saxpy"))))
    k = over_shim.library_get_kernel(lib, "saxpy")
    over_shim.param_layout(k)
    ctx = ctypes.c_void_p()
    over_shim.api("cuCtxGetCurrent", ctypes.byref(ctx))
    y, deferred = run_records(ex, ctx.value, k)
    assert np.all(y == 7.0) and len(deferred) == 1


# ---- on a GPU --------------------------------------------------------------------------------------------
def need_gpu() -> None:
    if not real_api.candidates():
        pytest.skip("needs an NVIDIA GPU and its driver (runs through the device tool, not in CI)")


@pytest.fixture
def gpu():
    need_gpu()
    d = open_driver("real")
    d.init(4)
    d.set_current(d.primary_ctx_retain(0))
    yield d
    d.close()


def capability(d) -> tuple[int, int]:
    attrs = d.init(80)["devices"][0]["attrs"]
    return attrs[75], attrs[76]


@pytest.mark.gpu
def test_on_a_gpu_a_trimmed_multi_architecture_fatbin_loads_and_its_CUkernel_launches(gpu):
    image = kernels_fatbin(build("saxpy", "multi"))
    small = trim(image, capability(gpu))
    assert len(small) < len(image)
    lib = gpu.library_load({}, memoryview(small))
    k = gpu.library_get_kernel(lib, "saxpy")
    assert [s for _, s in gpu.param_layout(k)] == [4, 8, 8, 4]
    n = 1000
    x, y = filled(gpu, n, 2.0), filled(gpu, n, 1.0)
    gpu.launch(k, (4, 1, 1), (256, 1, 1), 0, 0, None, saxpy_args(3.0, x, y, n))       # a CUkernel, as is
    gpu.launch(gpu.kernel_get_function(k), (4, 1, 1), (256, 1, 1), 0, 0, [PRIORITY], saxpy_args(1.0, x, y, n))
    gpu.ctx_synchronize()
    assert np.all(floats(gpu, y, n) == 9.0)
    assert gpu.kernel_get_attribute(0, k, 0) >= 256 and gpu.func_get_attribute(0, k) >= 256


@pytest.mark.gpu
def test_on_a_gpu_a_constant_symbol_is_a_library_global(gpu):
    lib = gpu.library_load({}, memoryview(kernels_fatbin(build("constant", "sm_90"))))
    ptr, size = gpu.library_get_global(lib, "coeffs")
    assert size == 16
    gpu.memcpy_htod(ptr, None, memoryview(np.array([1, 2, 0, 0], F32).tobytes()))
    x = filled(gpu, 50, 0.5)
    y = gpu.mem_alloc(200)
    gpu.launch(gpu.library_get_kernel(lib, "poly3"), (1, 1, 1), (64, 1, 1), 0, 0, None, struct.pack("<QQi", x, y, 50))
    assert np.allclose(floats(gpu, y, 50), 2.0)


@pytest.mark.gpu
def test_on_a_gpu_capture_info_graph_nodes_and_pools(gpu):
    lib = gpu.library_load({}, memoryview(kernels_fatbin(build("graph", "sm_90"))))
    capture_and_replay(gpu, gpu.library_get_kernel(lib, "saxpy"))
    pools(gpu)


@pytest.mark.gpu
def test_on_a_gpu_the_executor_loads_by_content_and_runs_ex_records(tmp_path, monkeypatch):
    import hashlib
    need_gpu()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ex = Executor(Session("t", "cuda", config.settings(environ={}, cuda_driver="real")))
    try:
        (_, ctx, _), _ = ex.handle(["primary_ctx_retain", 0, 0], [], True)
        image = trim(kernels_fatbin(build("saxpy", "multi")), capability(ex.driver))
        meta = ["image_load", ctx, "library", {}, hashlib.sha256(image).hexdigest(), len(image)]
        assert ex.handle(meta, [], True)[0][1] == {"send": True}
        code, lib, _ = ex.handle(meta, [memoryview(image)], True)[0]
        assert code == 0 and ex.handle(meta, [], True)[0][0] == 0          # known now: no bytes
        (_, k, _), _ = ex.handle(["library_get_kernel", ctx, lib, "saxpy"], [], True)
        ex.handle(["param_layout", ctx, k], [], True)
        y, deferred = run_records(ex, ctx, k)
        assert np.all(y == 7.0) and len(deferred) == 1
    finally:
        ex.close()


def test_the_real_drivers_thread_captures_in_relaxed_mode_so_one_client_thread_cannot_refuse_anothers_alloc(over_shim):
    """Every client thread's calls run on the server's one thread; torch allocates in relaxed mode during a capture."""
    mode = ctypes.c_int(0)                                  # exchange to global and read what the thread had
    over_shim.api("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))
    assert mode.value == 2                                  # CU_STREAM_CAPTURE_MODE_RELAXED
