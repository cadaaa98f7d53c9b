"""The fake CUDA driver and the cuda route's executor, called directly (no interceptor, no sockets)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from rgpu import config
from rgpu.server.cuda.base import CudaDriverError
from rgpu.server.cuda.fake import FakeDriver
from rgpu.server.cuda.fake_code import parse_entries
from rgpu.server.route import Session
from rgpu.server.cuda.executor import LAUNCH, Executor

PTX = """
.version 7.5
.target sm_75
.address_size 64
.visible .global .align 4 .u32 counter;
.visible .entry vecAdd(.param .u64 a, .param .u64 b, .param .u64 c, .param .u32 n) { ret; }
.visible .entry saxpy(.param .f32 alpha, .param .u64 .ptr .global .align 4 x, .param .u64 y, .param .u32 n) { ret; }
.visible .entry mystery(.param .align 8 .b8 blob[24], .param .u16 h) { ret; }
"""


@pytest.fixture
def drv():
    d = FakeDriver()
    d.set_current(d.primary_ctx_retain(0))
    return d


def put(d, arr):
    p = d.mem_alloc(arr.nbytes)
    d.memcpy_htod(p, None, memoryview(arr.tobytes()))
    return p


def test_ptx_parameters_are_laid_out_as_the_cuda_abi_does():
    e = parse_entries(PTX)
    assert [(p.offset, p.size) for p in e["vecAdd"].params] == [(0, 8), (8, 8), (16, 8), (24, 4)]
    assert [(p.offset, p.size) for p in e["saxpy"].params] == [(0, 4), (8, 8), (16, 8), (24, 4)]
    assert [(p.offset, p.size) for p in e["mystery"].params] == [(0, 24), (24, 2)]
    assert e["mystery"].arg_bytes == 26


def test_memory_copies_and_memsets_act_on_host_backed_allocations(drv):
    p = put(drv, np.arange(8, dtype=np.uint32))
    drv.memset(p + 8, 0xAB, 1, 4, None)
    got = np.frombuffer(bytes(drv.memcpy_dtoh(p, 32, None)), np.uint32)
    assert got[1] == 1 and got[2] == 0xABABABAB and got[3] == 3
    q = drv.mem_alloc(32)
    drv.memcpy_dtod(q, p, 32, None)
    assert bytes(drv.memcpy_dtoh(q, 32, None)) == bytes(drv.memcpy_dtoh(p, 32, None))
    free, total = drv.mem_get_info()
    assert free < total


def test_a_pointer_outside_every_allocation_is_an_illegal_address(drv):
    with pytest.raises(CudaDriverError) as exc:
        drv.memcpy_dtoh(0x1234, 4, None)
    assert exc.value.code == 700
    p = drv.mem_alloc(16)
    with pytest.raises(CudaDriverError) as exc:
        drv.memcpy_dtoh(p + 8, 16, None)          # runs off the end of its allocation
    assert exc.value.code == 1


def test_registered_kernels_run_on_the_cpu_with_checked_arguments(drv):
    mod, *_ = drv.module_load({}, PTX.encode() + b"\0")
    f = drv.module_get_function(mod, "vecAdd")
    a, b = np.arange(100, dtype=np.float32), np.ones(100, np.float32)
    pa, pb, pc = put(drv, a), put(drv, b), drv.mem_alloc(400)
    args = struct.pack("<QQQI", pa, pb, pc, 100)
    drv.launch(f, (1, 1, 1), (128, 1, 1), 0, 0, None, args)
    assert np.array_equal(np.frombuffer(bytes(drv.memcpy_dtoh(pc, 400, None)), np.float32), a + b)
    with pytest.raises(CudaDriverError, match="takes 28 bytes of arguments"):
        drv.launch(f, (1, 1, 1), (128, 1, 1), 0, 0, None, args[:24])
    g = drv.module_get_function(mod, "mystery")
    with pytest.raises(CudaDriverError, match="no CPU implementation"):
        drv.launch(g, (1, 1, 1), (1, 1, 1), 0, 0, None, bytes(26))


def test_module_globals_and_lookups_fail_like_the_driver(drv):
    mod, *_ = drv.module_load({}, PTX.encode() + b"\0")
    ptr, size = drv.module_get_global(mod, "counter")
    assert size == 4 and bytes(drv.memcpy_dtoh(ptr, 4, None)) == bytes(4)
    with pytest.raises(CudaDriverError) as exc:
        drv.module_get_function(mod, "nope")
    assert exc.value.code == 500
    with pytest.raises(CudaDriverError) as exc:
        drv.module_load({}, b"\x7fELF" + bytes(60))
    assert exc.value.code == 209                  # NO_BINARY_FOR_GPU: the fake runs PTX only


def test_a_captured_stream_records_and_its_graph_replays(drv):
    mod, *_ = drv.module_load({}, PTX.encode() + b"\0")
    f = drv.module_get_function(mod, "saxpy")
    x, y = put(drv, np.ones(16, np.float32)), put(drv, np.zeros(16, np.float32))
    s = drv.stream_create(1, 0)
    drv.stream_begin_capture(s, 0)
    drv.launch(f, (1, 1, 1), (16, 1, 1), 0, s, None, struct.pack("<fIQQI", 2.0, 0, x, y, 16))
    with pytest.raises(CudaDriverError):
        drv.stream_synchronize(s)                 # synchronising a capturing stream is refused
    g = drv.stream_end_capture(s)
    assert np.all(np.frombuffer(bytes(drv.memcpy_dtoh(y, 64, None)), np.float32) == 0)
    e = drv.graph_instantiate(g, 0)
    drv.graph_launch(e, s)
    drv.graph_launch(e, s)
    assert np.all(np.frombuffer(bytes(drv.memcpy_dtoh(y, 64, None)), np.float32) == 4)
    with pytest.raises(CudaDriverError):
        drv.stream_begin_capture(0, 0)            # the legacy stream cannot be captured


@pytest.fixture
def executor():
    ex = Executor(Session("t", "cuda", config.settings(environ={}, cuda_driver="fake")))
    yield ex
    ex.close()


def test_the_executor_answers_with_a_code_a_value_and_deferred_failures(executor):
    (code, info, deferred), _ = executor.handle(["init", 0, 4], [], True)
    assert code == 0 and info["devices"][0]["name"] == "rgpu fake device" and deferred == []
    (code, ctx, _), _ = executor.handle(["primary_ctx_retain", 0, 0], [], True)
    assert executor.handle(["mem_free", ctx, 0xBAD], [], False) is None          # posted: fails quietly...
    (code, value, deferred), _ = executor.handle(["mem_get_info", ctx], [], True)
    assert code == 0 and deferred[0][0] == "mem_free" and deferred[0][1] == 1    # ...and is told next time


def test_the_executor_refuses_what_is_not_a_driver_op(executor):
    (code, message, _), _ = executor.handle(["__init__", 0], [], True)
    assert code == 1 and "unknown cuda route op" in message


def test_launch_records_from_the_c_queue_run_in_order(executor):
    executor.handle(["init", 0, 4], [], True)
    (_, ctx, _), _ = executor.handle(["primary_ctx_retain", 0, 0], [], True)
    (_, (mod, _, _), _), _ = executor.handle(["module_load", ctx, {}], [memoryview(PTX.encode() + b"\0")], True)
    (_, f, _), _ = executor.handle(["module_get_function", ctx, mod, "saxpy"], [], True)
    (_, x, _), _ = executor.handle(["mem_alloc", ctx, 64], [], True)
    executor.handle(["memset", ctx, x, 0x3F800000, 4, 16, None], [], False)   # 1.0f
    records = b""
    for alpha in (1.0, 2.0):
        args = struct.pack("<fIQQI", alpha, 0, x, x, 16)
        size = (LAUNCH.size + len(args) + 7) // 8 * 8
        records += LAUNCH.pack(size, 1, f, ctx, 0, 1, 1, 1, 16, 1, 1, 0, len(args)) + args.ljust(size - LAUNCH.size, b"\0")
    executor.handle(["launches", 0], [memoryview(records)], False)
    (code, _, deferred), bufs = executor.handle(["memcpy_dtoh", ctx, x, 64, None], [], True)
    assert code == 0 and deferred == []
    assert np.all(np.frombuffer(bytes(bufs[0]), np.float32) == 6.0)   # (1 + 1*1) then (2 + 2*2)
