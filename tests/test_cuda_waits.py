"""One wait per training step: a synchronisation the server has just proven is answered in C, never lost.

The rule (shim_queue.c, cuda_intercept/README.md): a copy to the host on a stream, a stream synchronisation
and a context one are answered by the server only once that work is done; while nothing new has been queued
or sent since (on any stream), a second synchronisation of the same stream or context is answered in C.
torch's ``loss.item()`` is exactly that pair (cudaMemcpyAsync to the host, then cudaStreamSynchronize).
Measured on the loopback's round-trip count (the shim in this process) and, for the runtime, by a C program's
``RGPU_CUDA_WAIT_REPORT``; values against numpy.
"""
from __future__ import annotations

import ctypes
import logging
import textwrap
from ctypes import byref, c_float, c_int, c_size_t, c_uint, c_void_p

import numpy as np
import pytest

from test_cuda_programs import run
from test_cuda_queued_records import ONE, cu, native  # noqa: F401  (fixtures)
from test_cuda_shim import alloc, launch, u64
from test_cudart import cudart, fake_server  # noqa: F401  (fixtures)


def trips() -> int:
    from rgpu.cuda_intercept import client
    return client.get().conn.stats["round_trips"]


def item(cu, s, d, n=4):
    """loss.item(): the stream's value to the host, then the stream's synchronisation (its round trips)."""
    out = np.zeros(n, np.float32)
    before = trips()
    assert cu.cuMemcpyDtoHAsync_v2(out.ctypes.data_as(c_void_p), u64(d), c_size_t(out.nbytes), s) == 0
    assert cu.cuStreamSynchronize(s) == 0
    return out, trips() - before


@pytest.fixture
def stream(cu):
    s = c_void_p()
    assert cu.cuStreamCreate(byref(s), 1) == 0
    yield s
    assert cu.cuStreamDestroy_v2(s) == 0


def test_a_step_ending_in_item_waits_once_and_the_value_is_the_kernels(cu, stream):
    n = 64
    dx, dy = alloc(cu, 4 * n), alloc(cu, 4 * n)
    assert cu.cuMemsetD32Async(u64(dx), c_uint(ONE), c_size_t(n), stream) == 0
    assert cu.cuMemsetD32Async(u64(dy), c_uint(ONE), c_size_t(n), stream) == 0
    assert launch(cu, cu.saxpy, n, c_float(3), u64(dx), u64(dy), c_int(n), stream=stream) == 0
    out, waits = item(cu, stream, dy, n)
    assert waits == 1
    assert np.array_equal(out, np.full(n, 4.0, np.float32))
    before = trips()
    assert cu.cuStreamQuery(stream) == 0 and cu.cuStreamSynchronize(stream) == 0     # still idle: no trip
    assert trips() == before


def test_new_work_on_any_stream_or_any_message_makes_the_sync_wait(cu, stream):
    d, other = alloc(cu, 64), c_void_p()
    assert cu.cuStreamCreate(byref(other), 1) == 0
    item(cu, stream, d)
    assert cu.cuMemsetD8Async(u64(d), ctypes.c_ubyte(1), c_size_t(4), other) == 0    # queued in C, elsewhere
    before = trips()
    assert cu.cuStreamSynchronize(stream) == 0
    assert trips() == before + 1
    assert cu.cuMemcpyDtoDAsync_v2(u64(d + 16), u64(d), c_size_t(4), other) == 0      # posted by Python
    assert cu.cuStreamSynchronize(stream) == 0
    assert trips() == before + 2
    assert cu.cuStreamDestroy_v2(other) == 0


def test_only_the_proven_stream_and_context_are_answered(cu, stream):
    d = alloc(cu, 64)
    item(cu, stream, d)
    before = trips()
    assert cu.cuStreamSynchronize(None) == 0          # the legacy stream was not shown idle
    assert cu.cuCtxSynchronize() == 0                 # nor the context (other streams)
    assert trips() == before + 2
    assert cu.cuCtxSynchronize() == 0 and cu.cuStreamSynchronize(None) == 0   # the context was, just now
    assert cu.cuStreamSynchronize_ptsz(None) == 0
    assert trips() == before + 2
    assert cu.cuStreamSynchronize(stream) == 0       # an explicit stream's context is not known in C: asked
    assert trips() == before + 3


def test_a_queued_failure_comes_back_once_and_is_never_answered_away(cu, stream, caplog):
    d = alloc(cu, 64)
    out = np.zeros(4, np.float32)
    with caplog.at_level(logging.WARNING, logger="rgpu.cuda"):   # its own address: said once per text
        assert cu.cuMemsetD32Async(u64(0xBEEF0000), c_uint(1), c_size_t(12), stream) == 0
        assert cu.cuMemcpyDtoHAsync_v2(out.ctypes.data_as(c_void_p), u64(d), c_size_t(16), stream) != 0
    assert "memset failed on the server" in caplog.text
    before = trips()
    assert cu.cuStreamSynchronize(stream) == 0        # no proof came with a failure: the server is asked
    assert trips() == before + 1


def test_with_native_off_every_sync_goes_to_the_server(cu, stream, native):
    native(0)
    d = alloc(cu, 64)
    _, waits = item(cu, stream, d)
    assert waits == 2


ITEM_PY = textwrap.dedent(r"""
    import ctypes, threading
    from ctypes import byref, c_int, c_size_t, c_void_p
    rt, cu = ctypes.CDLL("libcudart.so.13"), ctypes.CDLL("libcuda.so.1")
    d, s, out = c_void_p(), c_void_p(), (ctypes.c_float * 4)()
    assert rt.cudaStreamCreate(byref(s)) == 0 and rt.cudaMalloc(byref(d), c_size_t(16)) == 0
    total = 0.0
    for step in range(5):                      # the loss's value, as torch's item() asks for it
        assert rt.cudaMemsetAsync(d, c_int(0), c_size_t(16), s) == 0
        assert rt.cudaMemcpyAsync(out, d, c_size_t(16), c_int(2), s) == 0      # cudaMemcpyDeviceToHost
        assert rt.cudaStreamSynchronize(s) == 0
        total += out[0]
    print("sum", total, "sync", rt.cudaDeviceSynchronize() | rt.cudaDeviceSynchronize())
    seen = []
    def first_call():                          # a new thread's first runtime call
        dev, cur = c_int(-1), c_void_p()
        rt.cudaGetDevice(byref(dev))
        cu.cuCtxGetCurrent(byref(cur))
        seen.append((dev.value, bool(cur.value)))
    t = threading.Thread(target=first_call)
    t.start(); t.join()
    print("thread", *seen[0])
""")


def test_the_runtimes_item_pattern_waits_once_and_a_new_thread_sees_the_primary_context(cudart, tmp_path,
                                                                                         fake_server):
    import sys
    (tmp_path / "item.py").write_text(ITEM_PY)
    done = run([sys.executable, tmp_path / "item.py"], fake_server, env={"RGPU_CUDA_WAIT_REPORT": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sum 0.0 sync 0" in done.stdout and "thread 0 True" in done.stdout, done.stdout + done.stderr
    report = next(line for line in done.stderr.splitlines() if "answered calls" in line)
    assert "memcpy_dtoh 5" in report and "stream_synchronize" not in report, report
    assert "ctx_synchronize 1" in report, report      # the second context sync was answered in C


def test_an_empty_captured_graph_has_no_nodes_and_a_bad_graph_is_named(cu, stream, caplog):
    """Inductor's CUDA-graph trees count a graph's nodes (NULL array) and then fetch them; an empty graph is
    fine both ways, and a failure names the graph the server was asked about."""
    g, count, nodes = c_void_p(), c_size_t(7), (c_void_p * 4)()
    assert cu.cuStreamBeginCapture_v2(stream, 1) == 0              # thread-local mode, as the trees capture
    assert cu.cuStreamEndCapture(stream, byref(g)) == 0 and g.value
    assert cu.cuGraphGetNodes(g, None, byref(count)) == 0 and count.value == 0
    count.value = 4
    assert cu.cuGraphGetNodes(g, nodes, byref(count)) == 0 and count.value == 0
    assert cu.cuGraphGetNodes(g, nodes, None) == 1                  # no count: INVALID_VALUE, as the driver says
    assert cu.cuGraphDestroy(g) == 0
    with caplog.at_level(logging.WARNING, logger="rgpu.cuda"):
        assert cu.cuGraphGetNodes(c_void_p(0xBAD0), None, byref(count)) != 0
    assert "cuGraphGetNodes(graph 0xbad0, nodes NULL" in caplog.text, caplog.text


TORCH_STEP = textwrap.dedent(r"""
    import json, sys, torch
    def waits():
        c = getattr(sys.modules.get("rgpu.cuda_intercept.client"), "_client", None)
        return dict(c.waits) if c is not None else {}
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 32, generator=g), torch.randn(32, 32, generator=g) / 32
    dx, dw = x.cuda(), w.cuda()
    steps = []
    for i in range(3):                         # the fake runs no torch kernel of its own: GEMMs, then item()
        before, y = waits(), dx
        for _ in range(4):
            y = y @ dw
        value = y[0, 0].item()
        steps.append({k: v - before.get(k, 0) for k, v in waits().items() if v != before.get(k, 0)})
    ref = x
    for _ in range(4):
        ref = ref @ w
    print(json.dumps({"steps": steps, "value": value, "ref": ref[0, 0].item()}))
""")


def test_stock_torchs_step_ending_in_item_waits_once(tmp_path, fake_server):
    """Stock torch 2.11+cu130 through ``rgpu intercept run``: a steady step's only wait is the loss's copy."""
    import json
    import os
    python = os.environ.get("RGPU_TEST_CUDA_TORCH_PYTHON")
    if not python:
        pytest.skip("set RGPU_TEST_CUDA_TORCH_PYTHON to a Python with stock torch 2.11+cu130 and rgpu importable")
    (tmp_path / "step.py").write_text(TORCH_STEP)
    done = run([python, tmp_path / "step.py"], fake_server, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["steps"][1:] == [{"memcpy_dtoh": 1}] * 2, out["steps"]
    assert abs(out["value"] - out["ref"]) <= 1e-6 * max(1.0, abs(out["ref"]))   # the CPU's GEMMs, in another order
