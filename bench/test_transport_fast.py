"""pytest-benchmark over the transport harness: shm and ucx beside their baselines, the ratio in ``extra_info``.

    python -m pytest bench/test_transport_fast.py --benchmark-only -p no:cacheprovider

Targets: shm upload of 64 MiB >= 0.80 of one-thread ``numpy.copyto``; shm 64 B round trip
<= 0.20 of rgpu's tcp; ucx upload of 64 MiB >= 0.90 of raw UCXX (worker-address endpoints).
The timed function is rgpu's; ``extra_info`` carries the interleaved comparison (median of 5).
Not part of the test suite (``testpaths`` is ``tests``); the targets are read, not asserted.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from rgpu.bench import harness
from rgpu.bench import transport as tb
from rgpu.bench import transport_fast as fast

MiB = 1 << 20


@pytest.fixture(scope="module")
def ctx():
    c = tb.Context(argparse.Namespace(server=None))
    before = os.sched_getaffinity(0)
    harness.pin_self(c.client_cpus)
    try:
        yield c
    finally:
        c.close()
        os.sched_setaffinity(0, before)


def _record(benchmark, result: dict, baseline: str, target: str) -> None:
    benchmark.extra_info.update({k: result[k] for k in ("value", "baseline", "ratio", "spread", "baseline_spread",
                                                        "ratio_spread", "runs")})
    benchmark.extra_info.update(baseline_name=baseline, target=target)


def _upload(benchmark, pairs: dict, target: str) -> None:
    rgpu, base = pairs["bandwidth"]
    src = np.arange(64 * MiB, dtype=np.uint8)
    view, stride = memoryview(src), tb.stride_for(src.nbytes)
    result = harness.compare(tb._bandwidth_fn(rgpu, src, 3), tb._bandwidth_fn(base, src, 3), repeats=5)
    _record(benchmark, result, base.name, target)
    assert benchmark.pedantic(rgpu.upload, args=(view, stride), rounds=10, warmup_rounds=1) == \
        tb.sampled_sum(src, stride)


@pytest.mark.skipif("shm" not in tb.TRANSPORTS, reason="shm is not available here")
def test_shm_upload_of_64_mib_beside_one_thread_copyto(benchmark, ctx):
    _upload(benchmark, fast.shm_pairs(ctx), "ratio >= 0.80 (GB/s)")


@pytest.mark.skipif("shm" not in tb.TRANSPORTS, reason="shm is not available here")
def test_shm_round_trip_of_64_bytes_beside_rgpu_tcp(benchmark, ctx):
    rgpu, tcp = fast.shm_pairs(ctx)["rtt"]
    for b in (rgpu, tcp):
        for _ in range(200):
            b.ping()
    result = harness.compare(tb._rtt_fn(rgpu, 2000), tb._rtt_fn(tcp, 2000), repeats=5)
    _record(benchmark, result, tcp.name, "ratio <= 0.20 (us)")
    benchmark.pedantic(rgpu.ping, rounds=2000, warmup_rounds=100)


@pytest.mark.skipif("ucx" not in tb.TRANSPORTS, reason="UCXX is not installed (pip install 'rgpu[ucx]')")
def test_ucx_upload_of_64_mib_beside_raw_ucxx(benchmark, ctx):
    _upload(benchmark, fast.ucx_pairs(ctx), "ratio >= 0.90 (GB/s)")
