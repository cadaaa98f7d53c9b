"""Memsets, event records, stream waits, frees, small copies and graph launches queued in C with the launches.

The shim is loaded in this process (test_cuda_support.shim_in_process) against
the cuda route's executor on the fake driver; the loopback's message count
says whether a call entered Python and crossed, so "no Python on the client's
path" is measured, and RGPU_NATIVE=off's Python posts (the reference) must
give the same values.
"""
from __future__ import annotations

import ctypes
import logging
import struct
import subprocess
import textwrap
from ctypes import byref, c_float, c_int, c_size_t, c_uint, c_void_p

import numpy as np
import pytest

from test_cuda_programs import run
from test_cuda_shim import alloc, download, launch, ptx, u64
from test_cuda_support import cuda_headers_or_skip
from test_cudart import cudart, fake_server  # noqa: F401  (fixtures)
from rgpu.protocol.cuda import OP
from test_cuda_support import Loopback, shim_in_process

ONE = 0x3F800000          # 1.0f, the bits cuMemsetD32 writes


@pytest.fixture(scope="module")
def cu():
    lib = shim_in_process()
    ctx = c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    mod, f = c_void_p(), c_void_p()
    assert lib.cuModuleLoadData(byref(mod), ctypes.c_char_p(ptx())) == 0
    assert lib.cuModuleGetFunction(byref(f), mod, b"saxpy") == 0
    lib.saxpy = f
    return lib


@pytest.fixture
def native(cu):
    """Switch C's queueing of these calls on or off (RGPU_NATIVE=off) for one test; back on after."""
    from rgpu.cuda_intercept import client
    lib = client.get().lib
    yield lib.rgpu_records_native
    lib.rgpu_records_native(1)


def messages() -> int:
    from rgpu.cuda_intercept import client
    return client.get().conn.stats["messages"]


def sequence(cu, n=256):
    """memset, H2D copy, event record, stream wait, launch, D2D copies, free: what crossed, and y = 2 * 1 + y0
    (read from its second device-to-device copy)."""
    dx, dy, dtmp = alloc(cu, 4 * n), alloc(cu, 4 * n), alloc(cu, 64)
    dz, dw = alloc(cu, 4 * n), alloc(cu, 4 * n)
    s1, s2, ev = c_void_p(), c_void_p(), c_void_p()
    assert cu.cuStreamCreate(byref(s1), 1) == 0 and cu.cuStreamCreate(byref(s2), 1) == 0
    assert cu.cuEventCreate(byref(ev), 0) == 0
    y0 = np.arange(n, dtype=np.float32)
    assert cu.cuCtxSynchronize() == 0
    before = messages()
    assert cu.cuMemsetD32Async(u64(dx), c_uint(ONE), c_size_t(n), s1) == 0
    assert cu.cuMemsetD8_v2(u64(dtmp), ctypes.c_ubyte(7), c_size_t(64)) == 0
    assert cu.cuMemcpyHtoDAsync_v2(u64(dy), y0.ctypes.data_as(c_void_p), c_size_t(y0.nbytes), s1) == 0
    y0[:] = -1                                               # the bytes were taken at the call, as a copy's are
    assert cu.cuEventRecord(ev, s1) == 0
    assert cu.cuStreamWaitEvent(s2, ev, 0) == 0
    assert launch(cu, cu.saxpy, n, c_float(2), u64(dx), u64(dy), c_int(n), stream=s2) == 0
    assert cu.cuMemcpyDtoDAsync_v2(u64(dz), u64(dy), c_size_t(4 * n), s2) == 0
    assert cu.cuMemFree_v2(u64(dtmp)) == 0
    crossed = messages() - before
    assert cu.cuStreamSynchronize(s2) == 0
    before = messages()
    assert cu.cuMemcpyDtoD_v2(u64(dw), u64(dz), c_size_t(4 * n)) == 0     # the legacy stream's form
    crossed += messages() - before
    y = download(cu, dw, np.zeros(n, np.float32))
    for d in (dx, dy, dz, dw):
        assert cu.cuMemFree_v2(u64(d)) == 0
    assert cu.cuCtxSynchronize() == 0
    return crossed, y


def test_the_sequence_is_queued_in_c_and_nothing_crosses_until_the_sync(cu):
    crossed, y = sequence(cu)
    assert crossed == 0                                      # no post, no call: no Python on the way
    assert np.array_equal(y, 2 * np.ones(256, np.float32) + np.arange(256, dtype=np.float32))


def test_with_native_off_python_posts_each_call_and_the_values_are_the_same(cu, native):
    native(0)
    crossed, y = sequence(cu)
    assert crossed >= 6                                      # one post per call (the launch is C's either way)
    assert np.array_equal(y, 2 * np.ones(256, np.float32) + np.arange(256, dtype=np.float32))


def test_a_failing_queued_memset_is_reported_at_the_next_sync(cu, caplog):
    with caplog.at_level(logging.WARNING, logger="rgpu.cuda"):
        assert cu.cuMemsetD32_v2(u64(0xDEAD0000), c_uint(1), c_size_t(16)) == 0    # queued: nothing said yet
        assert cu.cuCtxSynchronize() != 0
    assert "memset failed on the server" in caplog.text
    assert cu.cuCtxSynchronize() == 0


def test_a_free_in_c_forgets_the_allocation_for_every_later_question(cu):
    d = alloc(cu, 4096)
    base, size = u64(), c_size_t()
    assert cu.cuMemGetAddressRange_v2(byref(base), byref(size), u64(d + 8)) == 0 and base.value == d
    before = messages()
    assert cu.cuMemFree_v2(u64(d)) == 0
    assert messages() == before
    assert cu.cuMemGetAddressRange_v2(byref(base), byref(size), u64(d + 8)) == 1    # Python's answer: gone
    assert cu.cuMemFree_v2(u64(d)) == 1                      # a second free: INVALID_VALUE, as the Python path says
    assert cu.cuMemFree_v2(u64(0)) == 0
    assert cu.cuCtxSynchronize() == 0


def test_stream_ordered_frees_and_per_thread_forms_queue_too(cu):
    d, s = u64(), c_void_p()
    assert cu.cuStreamCreate(byref(s), 1) == 0
    assert cu.cuMemAllocAsync(byref(d), c_size_t(1024), s) == 0
    before = messages()
    assert cu.cuMemsetD16Async_ptsz(d, ctypes.c_ushort(0x0101), c_size_t(512), None) == 0
    assert cu.cuMemFreeAsync(d, s) == 0
    assert messages() == before
    assert cu.cuCtxSynchronize() == 0


def test_a_captured_graph_replays_from_the_c_queue(cu):
    n = 64
    dy = alloc(cu, 4 * n)
    dx = alloc(cu, 4 * n)
    assert cu.cuMemsetD32_v2(u64(dx), c_uint(ONE), c_size_t(n)) == 0
    assert cu.cuMemsetD32_v2(u64(dy), c_uint(0), c_size_t(n)) == 0
    s, g, ge = c_void_p(), c_void_p(), c_void_p()
    assert cu.cuStreamCreate(byref(s), 1) == 0
    assert cu.cuStreamBeginCapture_v2(s, 0) == 0
    assert launch(cu, cu.saxpy, n, c_float(1), u64(dx), u64(dy), c_int(n), stream=s) == 0
    assert cu.cuStreamEndCapture(s, byref(g)) == 0
    assert cu.cuGraphInstantiateWithFlags(byref(ge), g, u64(0)) == 0
    before = messages()
    for _ in range(4):
        assert cu.cuGraphLaunch(ge, s) == 0
    assert messages() == before
    assert cu.cuStreamSynchronize(s) == 0
    assert np.all(download(cu, dy, np.zeros(n, np.float32)) == 4.0)


def test_a_copy_over_the_bound_keeps_its_own_message(cu):
    from rgpu.protocol.cuda import QUEUED_COPY_BYTES
    big = np.ones(QUEUED_COPY_BYTES // 4 + 1, np.float32)
    d = alloc(cu, big.nbytes)
    before = messages()
    assert cu.cuMemcpyHtoDAsync_v2(u64(d), big.ctypes.data_as(c_void_p), c_size_t(big.nbytes), None) == 0
    assert messages() > before
    assert np.array_equal(download(cu, d, big), big)


def test_a_malformed_queued_record_is_an_error_for_that_session_named_never_a_crash():
    from rgpu.protocol.cuda import MEMSET_KIND, NO_STREAM, OP
    lb = Loopback()
    bad = OP.pack(OP.size, MEMSET_KIND, 0, NO_STREAM, 0x1000, 3 << 32, 4)      # 3-byte elements: no such memset
    lb.executor.handle(["launches", 0], [memoryview(bad)], False)
    short = struct.pack("<II", 16, MEMSET_KIND) + bytes(8)                      # shorter than its fixed part
    lb.executor.handle(["launches", 0], [memoryview(short)], False)
    code, _, deferred = lb.executor.handle(["mem_get_info", 0], [], True)[0]
    assert code != 0 or deferred     # mem_get_info needs a context: either way the session goes on
    assert [d[0] for d in deferred] == ["launches", "launches"]
    assert all("malformed queued record" in d[2] for d in deferred)
    lb.close()


def test_capture_info_with_dependencies_takes_one_round_trip_and_names_the_last_node(cu):
    from rgpu.cuda_intercept import client
    n = 32
    dx, dy = alloc(cu, 4 * n), alloc(cu, 4 * n)
    s, g, status, cid = c_void_p(), c_void_p(), c_int(), ctypes.c_uint64()
    deps, count, nodes = ctypes.POINTER(c_void_p)(), c_size_t(), (c_void_p * 4)()
    assert cu.cuStreamCreate(byref(s), 1) == 0
    assert cu.cuStreamBeginCapture_v2(s, 0) == 0
    assert launch(cu, cu.saxpy, n, c_float(1), u64(dx), u64(dy), c_int(n), stream=s) == 0
    trips = client.get().conn.stats["round_trips"]
    assert cu.cuStreamGetCaptureInfo_v2(s, byref(status), byref(cid), byref(g), byref(deps), byref(count)) == 0
    assert client.get().conn.stats["round_trips"] == trips + 1
    assert status.value == 1 and cid.value and g.value and count.value == 1
    ncount = c_size_t(4)
    assert cu.cuGraphGetNodes(g, nodes, byref(ncount)) == 0
    assert deps[0] == nodes[ncount.value - 1]
    out = c_void_p()
    assert cu.cuStreamEndCapture(s, byref(out)) == 0


def test_a_pools_access_is_its_owners_and_a_peer_is_refused(cu):
    class Location(ctypes.Structure):
        _fields_ = [("type", c_int), ("id", c_int)]

    class AccessDesc(ctypes.Structure):
        _fields_ = [("location", Location), ("flags", c_int)]

    pool, flags = c_void_p(), c_int(-1)
    assert cu.cuDeviceGetDefaultMemPool(byref(pool), 0) == 0
    assert cu.cuMemPoolGetAccess(byref(flags), pool, byref(Location(1, 0))) == 0 and flags.value == 3
    assert cu.cuMemPoolGetAccess(byref(flags), pool, byref(Location(1, 1))) == 0 and flags.value == 0
    assert cu.cuMemPoolSetAccess(pool, byref(AccessDesc(Location(1, 0), 3)), c_size_t(1)) == 0
    assert cu.cuMemPoolSetAccess(pool, byref(AccessDesc(Location(1, 1), 3)), c_size_t(1)) == 801


def test_the_c_walker_launches_plain_records_and_hands_every_other_kind_back():
    from rgpu.protocol.cuda import LAUNCH, LAUNCH_KIND, MEMSET_KIND, NO_STREAM, OP
    from rgpu.server.cuda import real_batch
    lib = real_batch.library()
    if lib is None:
        pytest.skip("no C compiler for the server's record walker here")
    launched = []
    launch_t = ctypes.CFUNCTYPE(c_int, *([c_void_p] + [c_uint] * 7 + [c_void_p] * 3))
    set_ctx_t = ctypes.CFUNCTYPE(c_int, c_void_p)
    on_launch = launch_t(lambda f, *rest: launched.append(f) or 0)
    on_ctx = set_ctx_t(lambda c: 0)
    rec = (LAUNCH.pack(LAUNCH.size, LAUNCH_KIND, 0x100, 7, 0, 1, 1, 1, 32, 1, 1, 0, 0)
           + OP.pack(OP.size, MEMSET_KIND, 7, NO_STREAM, 0x1000, 1 << 32, 4))     # 48 bytes: shorter than a launch
    buf = ctypes.create_string_buffer(rec, len(rec))
    pos, ctx = c_size_t(0), ctypes.c_uint64(7)
    rc = lib.rgpu_walk_records(ctypes.cast(on_launch, c_void_p), ctypes.cast(on_ctx, c_void_p), buf, len(rec),
                               byref(pos), byref(ctx), None)
    assert (rc, pos.value, launched) == (-2, LAUNCH.size, [0x100])   # the memset is the executor's, never skipped


def test_the_c_walker_runs_event_records_waits_graph_launches_and_copies_in_order_and_stops_at_a_failure():
    """The queued ops the walk has entry points for run in C, in the queue's order, each with the driver call
    records.py would have made; a memset or a free (its quota is the executor's) and a failing call stop the
    walk at that record, which the executor then runs (and explains)."""
    from rgpu.protocol.cuda import (EVENT_RECORD_KIND, GRAPH_LAUNCH_KIND, LAUNCH, LAUNCH_KIND, MEM_FREE_KIND,
                                    MEMCPY_DTOD_KIND, MEMCPY_HTOD_KIND, NO_STREAM, STREAM_WAIT_KIND)
    from rgpu.server.cuda import real_batch
    lib = real_batch.library()
    if lib is None:
        pytest.skip("no C compiler for the server's record walker here")
    calls, fail = [], {"on": None}

    def on(name):
        def call(*args):
            values = [a if isinstance(a, int) else (a or 0) for a in args]
            calls.append((name, *values))
            return 700 if name == fail["on"] else 0
        return call
    p, u = c_void_p, c_uint
    types = {"launch": [p] + [u] * 7 + [p] * 3, "set_ctx": [p], "event_record": [p, p],
             "event_record_with_flags": [p, p, u], "stream_wait_event": [p, p, u], "graph_launch": [p, p],
             "memcpy_htod": [ctypes.c_uint64, p, c_size_t], "memcpy_htod_async": [ctypes.c_uint64, p, c_size_t, p],
             "memcpy_dtod": [ctypes.c_uint64, ctypes.c_uint64, c_size_t],
             "memcpy_dtod_async": [ctypes.c_uint64, ctypes.c_uint64, c_size_t, p]}
    keep = {name: ctypes.CFUNCTYPE(c_int, *args)(on(name)) for name, args in types.items()}
    ops = real_batch.DriverOps(**{name: ctypes.cast(fn, c_void_p).value for name, fn in keep.items()})
    data = bytes(range(16))
    rec = (OP.pack(OP.size, EVENT_RECORD_KIND, 7, 5, 0xE1, 0, 0)
           + OP.pack(OP.size, EVENT_RECORD_KIND, 8, 5, 0xE2, 1, 0)              # with flags, another context
           + OP.pack(OP.size, STREAM_WAIT_KIND, 8, 6, 0xE2, 0, 0)
           + OP.pack(OP.size, GRAPH_LAUNCH_KIND, 8, 6, 0x6E, 0, 0)
           + OP.pack(OP.size + 16, MEMCPY_HTOD_KIND, 8, 6, 0xD0, 16, 0) + data
           + OP.pack(OP.size + 16, MEMCPY_HTOD_KIND, 8, NO_STREAM, 0xD1, 16, 0) + data
           + OP.pack(OP.size, MEMCPY_DTOD_KIND, 8, 6, 0xD2, 0xD0, 1 << 20)
           + OP.pack(OP.size, MEMCPY_DTOD_KIND, 8, NO_STREAM, 0xD3, 0xD2, 1 << 20)
           + LAUNCH.pack(LAUNCH.size, LAUNCH_KIND, 0x100, 8, 6, 1, 1, 1, 32, 1, 1, 0, 0)
           + OP.pack(OP.size, MEM_FREE_KIND, 8, NO_STREAM, 0xD0, 0, 0))
    buf = ctypes.create_string_buffer(rec, len(rec))
    base = ctypes.addressof(buf)

    def walk(start=0):
        pos, ctx = c_size_t(start), ctypes.c_uint64(7)
        return lib.rgpu_walk_all(byref(ops), base, len(rec), byref(pos), byref(ctx), None), pos.value
    rc, pos = walk()
    copies = [c for c in calls if c[0].startswith("memcpy_htod")]
    assert [c[0] for c in calls] == ["event_record", "set_ctx", "event_record_with_flags", "stream_wait_event",
                                     "graph_launch", "memcpy_htod_async", "memcpy_htod", "memcpy_dtod_async",
                                     "memcpy_dtod", "launch"]
    assert calls[7:9] == [("memcpy_dtod_async", 0xD2, 0xD0, 1 << 20, 6), ("memcpy_dtod", 0xD3, 0xD2, 1 << 20)]
    assert calls[:5] == [("event_record", 0xE1, 5), ("set_ctx", 8), ("event_record_with_flags", 0xE2, 5, 1),
                         ("stream_wait_event", 6, 0xE2, 0), ("graph_launch", 0x6E, 6)]
    assert [(c[1], c[3]) for c in copies] == [(0xD0, 16), (0xD1, 16)]
    assert ctypes.string_at(copies[0][2], 16) == data         # the bytes where the record holds them
    assert (rc, pos) == (-2, len(rec) - OP.size)              # the free is the executor's
    calls.clear()
    fail["on"] = "stream_wait_event"
    assert walk() == (700, 2 * OP.size)                        # stopped at the failing wait, left for the executor
    assert [c[0] for c in calls][-1] == "stream_wait_event"


@pytest.mark.gpu
def test_on_a_gpu_the_queued_kinds_run_in_order_on_the_real_driver():
    from rgpu.protocol.cuda import EVENT_RECORD_KIND, MEM_FREE_KIND, MEMCPY_HTOD_KIND, MEMSET_KIND, NO_STREAM
    from rgpu.server.cuda import real_api
    if not real_api.candidates():
        pytest.skip("needs an NVIDIA GPU and its driver (runs through the device tool, not in CI)")
    lb = Loopback("real")
    ex = lb.executor
    ex.driver.init(4)
    ctx = ex.driver.primary_ctx_retain(0)
    run = lambda *m: ex.handle(list(m), [], True)[0]    # noqa: E731
    d = run("mem_alloc", ctx, 64)[1]
    e = run("event_create", ctx, 0)[1]
    data = bytes(range(16))
    rec = (OP.pack(OP.size, MEMSET_KIND, ctx, NO_STREAM, d, 0xAB | 1 << 32, 64)
           + OP.pack(OP.size + 16, MEMCPY_HTOD_KIND, ctx, 0, d, 16, 0) + data
           + OP.pack(OP.size, EVENT_RECORD_KIND, ctx, 0, e, 0, 0))
    ex.handle(["launches", 0], [memoryview(rec)], False)
    code, _, deferred = run("event_synchronize", ctx, e)
    assert code == 0 and not deferred
    got = bytes(ex.driver.memcpy_dtoh(d, 64, None))
    assert got == data + bytes([0xAB]) * 48
    ex.handle(["launches", 0], [memoryview(OP.pack(OP.size, MEM_FREE_KIND, ctx, NO_STREAM, d, 0, 0))], False)
    assert run("ctx_synchronize", ctx)[0] == 0 and ex.held.total == 0
    lb.close()


def test_the_real_drivers_code_runs_the_queued_kinds_over_the_interceptor(monkeypatch):
    """The real driver's ctypes path and its C walker, on rgpu's own libcuda.so.1 (which forwards to the fake)."""
    from rgpu import config
    from rgpu.protocol.cuda import EVENT_RECORD_KIND, MEM_FREE_KIND, MEMCPY_HTOD_KIND, MEMSET_KIND, NO_STREAM
    from rgpu.server.cuda import real, real_api
    from rgpu.server.route import Session
    from rgpu.server.cuda.executor import Executor
    shim = shim_in_process()
    lib = ctypes.CDLL(shim._name)
    monkeypatch.setattr(real, "load", lambda: real_api.typed(lib))
    saved = c_void_p()
    shim.cuCtxGetCurrent(byref(saved))
    ex = Executor(Session("t", "cuda", config.settings(environ={}, cuda_driver="fake")))
    ex.driver = d = real.RealDriver()
    try:
        d.init(4)
        ctx = d.primary_ctx_retain(0)
        d.set_current(ctx)
        ptr = ex.handle(["mem_alloc", ctx, 64], [], True)[0][1]
        ev = d.event_create(0)
        data = bytes(range(16))
        rec = (OP.pack(OP.size, MEMSET_KIND, ctx, NO_STREAM, ptr, 0xAB | 1 << 32, 64)
               + OP.pack(OP.size + 16, MEMCPY_HTOD_KIND, ctx, 0, ptr, 16, 0) + data
               + OP.pack(OP.size, EVENT_RECORD_KIND, ctx, 0, ev, 0, 0))
        ex.handle(["launches", 0], [memoryview(rec)], False)
        assert ex.deferred == []
        d.event_synchronize(ev)
        assert bytes(d.memcpy_dtoh(ptr, 64, None)) == data + bytes([0xAB]) * 48
        ex.handle(["launches", 0], [memoryview(OP.pack(OP.size, MEM_FREE_KIND, ctx, NO_STREAM, ptr, 0, 0))], False)
        assert ex.deferred == [] and ex.held.total == 0
    finally:
        d.close()
        shim.cuCtxSetCurrent(saved)


RUNTIME_GAPS_C = textwrap.dedent(r"""
    #include <cuda_runtime_api.h>
    #include <stdio.h>
    int main(void) {
        cudaMemPool_t pool; void *p; cudaStream_t st; cudaGraph_t gr = 0, out;
        enum cudaMemAccessFlags f = cudaMemAccessFlagsProtNone; enum cudaStreamCaptureStatus cs;
        unsigned long long id = 0; const cudaGraphNode_t *deps = 0; size_t nd = 0;
        struct cudaMemLocation loc = {cudaMemLocationTypeDevice, 0};
        struct cudaMemAccessDesc d = {{cudaMemLocationTypeDevice, 0}, cudaMemAccessFlagsProtReadWrite};
        cudaSetDevice(0);
        int same = cudaDeviceEnablePeerAccess(0, 0), other = cudaDeviceEnablePeerAccess(1, 0);
        int dis = cudaDeviceDisablePeerAccess(0);
        cudaGetLastError();
        cudaDeviceGetDefaultMemPool(&pool, 0);
        int g = cudaMemPoolGetAccess(&f, pool, &loc), s = cudaMemPoolSetAccess(pool, &d, 1);
        cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
        cudaMalloc(&p, 64);
        cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
        cudaMemsetAsync(p, 0, 64, st);
        int ci = cudaStreamGetCaptureInfo(st, &cs, &id, &gr, &deps, NULL, &nd);
        cudaStreamEndCapture(st, &out);
        printf("peer %d %d %d\npool %d %d %d\ncapture %d %d %d %zu %d\n", same, other, dis, g, (int)f, s, ci,
               (int)cs, id != 0, nd, gr == out);
        return 0;
    }
""")


def test_the_runtime_answers_peer_access_pool_access_and_capture_dependencies(cudart, tmp_path, fake_server):  # noqa: F811
    include = cuda_headers_or_skip()
    src = tmp_path / "gaps.c"
    src.write_text(RUNTIME_GAPS_C)
    exe = tmp_path / "gaps"
    subprocess.run(["cc", "-O1", f"-I{include}", str(src), "-o", str(exe), f"-L{cudart.parent}",
                    "-l:libcudart.so.13", "-l:libcuda.so.1", f"-Wl,-rpath,{cudart.parent}"], check=True)
    done = run([exe], fake_server)
    assert done.returncode == 0, done.stdout + done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert out["peer"] == "101 101 101"        # cudaErrorInvalidDevice: the same device, and no device 1 here
    assert out["pool"] == "0 3 0"              # the owner reads and writes
    assert out["capture"] == "0 1 1 1 1"       # active, an id, one dependency (the memset), the capture's graph
