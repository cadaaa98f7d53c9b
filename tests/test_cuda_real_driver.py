"""The real-driver half of the cuda route: its ctypes plumbing checked here against rgpu's own libcuda.so.1,
and on an NVIDIA GPU (``-m gpu``, through the device tool) against the real one.

Here RealDriver drives rgpu's interceptor loaded in this process, whose client
forwards to the fake driver: every signature, out-parameter and flow of the
real driver's code runs, without a GPU.
"""
from __future__ import annotations

import ctypes
import shutil
import struct

import numpy as np
import pytest

from rgpu.errors import ConfigError
from rgpu.server.cuda.base import CudaDriverError
from rgpu.server.cuda import open_driver, real, real_api
from test_cuda_support import shim_in_process


def _ptx() -> bytes:
    from test_cuda_shim import ptx
    return ptx()


@pytest.fixture
def over_shim(monkeypatch):
    """A RealDriver whose libcuda.so.1 is rgpu's own (in this process, forwarding to the fake driver)."""
    shim = shim_in_process()
    lib = ctypes.CDLL(shim._name)              # own function objects: argtypes do not leak into other tests
    monkeypatch.setattr(real, "load", lambda: real_api.typed(lib))
    saved = ctypes.c_void_p()
    shim.cuCtxGetCurrent(ctypes.byref(saved))
    drv = real.RealDriver()
    yield drv
    drv.close()
    shim.cuCtxSetCurrent(saved)


def test_the_real_driver_never_loads_rgpus_own_interceptor(monkeypatch):
    shim = shim_in_process()
    monkeypatch.setattr(real_api, "candidates", lambda: [shim._name])
    with pytest.raises(ConfigError, match="rgpu's own interceptor"):
        real_api.load()


def test_auto_falls_back_to_the_fake_driver_where_there_is_no_gpu(monkeypatch):
    monkeypatch.setattr(real_api, "candidates", lambda: [])
    assert open_driver("auto").name == "fake"
    with pytest.raises(ConfigError, match="not usable here"):
        open_driver("real")


def test_real_driver_code_runs_a_kernel_end_to_end_over_the_interceptor(over_shim):
    drv = over_shim
    info = drv.init(20)
    assert info["devices"][0]["name"] == "rgpu fake device" and info["devices"][0]["attrs"][1] == 1024
    ctx = drv.primary_ctx_retain(0)
    drv.set_current(ctx)
    mod, info_log, error_log = drv.module_load({}, memoryview(_ptx()))
    f = drv.module_get_function(mod, "vecAdd")
    assert drv.param_layout(f) == [[0, 8], [8, 8], [16, 8], [24, 4]]
    n = 64
    a = np.arange(n, dtype=np.float32)
    pa, pc = drv.mem_alloc(4 * n), drv.mem_alloc(4 * n)
    drv.memcpy_htod(pa, None, memoryview(a.tobytes()))
    drv.launch(f, (1, 1, 1), (n, 1, 1), 0, 0, None, struct.pack("<QQQI", pa, pa, pc, n))
    drv.ctx_synchronize()
    assert np.array_equal(np.frombuffer(bytes(drv.memcpy_dtoh(pc, 4 * n, None)), np.float32), 2 * a)
    drv.memset(pc, 0, 4, n, None)
    assert bytes(drv.memcpy_dtoh(pc, 16, None)) == bytes(16)
    assert drv.mem_get_address_range(pc + 8)[0] == pc
    free, total = drv.mem_get_info()
    assert 0 < free <= total
    drv.mem_free(pa)
    drv.mem_free(pc)


def test_real_driver_streams_events_and_graphs_over_the_interceptor(over_shim):
    drv = over_shim
    drv.init(4)
    ctx = drv.primary_ctx_retain(0)
    drv.set_current(ctx)
    mod, *_ = drv.module_load({}, memoryview(_ptx()))
    f = drv.module_get_function(mod, "saxpy")
    n = 32
    x, y = drv.mem_alloc(4 * n), drv.mem_alloc(4 * n)
    drv.memset(x, 0x3F800000, 4, n, None)
    drv.memset(y, 0, 4, n, None)
    s = drv.stream_create(1, 0)
    e0, e1 = drv.event_create(0), drv.event_create(0)
    drv.event_record(e0, s)
    drv.stream_begin_capture(s, 0)
    drv.launch(f, (1, 1, 1), (n, 1, 1), 0, s, None, struct.pack("<fIQQI", 1.0, 0, x, y, n))
    g = drv.stream_end_capture(s)
    ge = drv.graph_instantiate(g, 0)
    drv.graph_launch(ge, s)
    drv.graph_launch(ge, s)
    drv.event_record(e1, s)
    drv.stream_synchronize(s)
    assert drv.event_elapsed_time(e0, e1) >= 0
    assert np.all(np.frombuffer(bytes(drv.memcpy_dtoh(y, 4 * n, None)), np.float32) == 2.0)
    drv.graph_exec_destroy(ge)
    drv.graph_destroy(g)
    drv.stream_destroy(s)


def test_real_driver_links_ptx_and_loads_the_result_over_the_interceptor(over_shim):
    drv = over_shim
    drv.init(4)
    drv.set_current(drv.primary_ctx_retain(0))
    link = drv.link_create({})
    drv.link_add_data(link, 1, "k.ptx", {}, memoryview(_ptx()))
    image, info, error = drv.link_complete(link)
    drv.link_destroy(link)
    mod, *_ = drv.module_load({}, memoryview(image))
    assert drv.param_layout(drv.module_get_function(mod, "noop")) == []


@pytest.mark.gpu
def test_on_a_gpu_the_real_driver_runs_the_ptx_vector_add():
    if not real_api.candidates():
        pytest.skip("needs an NVIDIA GPU and its driver (runs through the device tool, not in CI)")
    drv = open_driver("real")
    drv.init(4)
    drv.set_current(drv.primary_ctx_retain(0))
    mod, *_ = drv.module_load({}, memoryview(_ptx()))
    f = drv.module_get_function(mod, "vecAdd")
    n = 1 << 16
    a = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    pa, pc = drv.mem_alloc(4 * n), drv.mem_alloc(4 * n)
    drv.memcpy_htod(pa, None, memoryview(a.tobytes()))
    drv.launch(f, ((n + 255) // 256, 1, 1), (256, 1, 1), 0, 0, None, struct.pack("<QQQI", pa, pa, pc, n))
    np.testing.assert_array_equal(np.frombuffer(bytes(drv.memcpy_dtoh(pc, 4 * n, None)), np.float32), a + a)
    drv.close()


@pytest.mark.gpu
def test_on_a_gpu_nvcc_is_there_for_the_c_program():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs an NVIDIA GPU (runs through the device tool, not in CI)")
    assert real_api.candidates()


def test_real_driver_falls_back_to_kernelParams_pointing_into_the_packed_buffer(over_shim):
    drv = over_shim
    drv.init(4)
    drv.set_current(drv.primary_ctx_retain(0))
    mod, *_ = drv.module_load({}, memoryview(_ptx()))
    f = drv.module_get_function(mod, "vecAdd")
    drv.param_layout(f)
    drv.code.by_params.add(f)                   # as after a driver refused the buffer through extra
    n = 16
    a = np.arange(n, dtype=np.float32)
    pa, pc = drv.mem_alloc(4 * n), drv.mem_alloc(4 * n)
    drv.memcpy_htod(pa, None, memoryview(a.tobytes()))
    drv.launch(f, (1, 1, 1), (n, 1, 1), 0, 0, None, struct.pack("<QQQI", pa, pa, pc, n))
    assert np.array_equal(np.frombuffer(bytes(drv.memcpy_dtoh(pc, 4 * n, None)), np.float32), 2 * a)


def test_the_executor_hands_launch_records_to_the_real_drivers_c_loop(over_shim):
    from rgpu import config
    from rgpu.server.route import Session
    from rgpu.server.cuda.executor import LAUNCH, Executor
    drv = over_shim
    assert drv.code._batch is not None, "the C batch launcher did not build (no C compiler?)"
    ex = Executor(Session("t", "cuda", config.settings(environ={}, cuda_driver="fake")))
    ex.driver = drv
    drv.init(4)
    ctx = drv.primary_ctx_retain(0)
    drv.set_current(ctx)
    mod, *_ = drv.module_load({}, memoryview(_ptx()))
    f = drv.module_get_function(mod, "saxpy")
    drv.param_layout(f)
    n = 16
    x = drv.mem_alloc(4 * n)
    drv.memset(x, 0x3F800000, 4, n, None)             # 1.0f

    def record(alpha, ptr, func=f):
        args = struct.pack("<fIQQI", alpha, 0, ptr, ptr, n)
        size = (LAUNCH.size + len(args) + 7) // 8 * 8
        return LAUNCH.pack(size, 1, func, ctx, 0, 1, 1, 1, n, 1, 1, 0, len(args)) + args.ljust(size - LAUNCH.size, b"\0")

    bad = record(1.0, 0xDEAD0000)                     # fails on the fake behind the interceptor, later
    refused = record(1.0, x, func=0x9990)             # fails at once, inside the C loop: deferred, loop goes on
    ex.handle(["launches", 0], [memoryview(record(1.0, x) + bad + refused + record(2.0, x))], False)
    assert [d[1] for d in ex.deferred] == [400]
    with pytest.raises(CudaDriverError) as exc:
        drv.ctx_synchronize()                         # the bad one's fault, reported at the sync as on a GPU
    assert exc.value.code == 700
    # (1 + 1*1) = 2, then (2 + 2*2) = 6: the records around the bad one ran, in order
    assert np.all(np.frombuffer(bytes(drv.memcpy_dtoh(x, 4 * n, None)), np.float32) == 6.0)
