"""pytest-benchmark over the transport harness: rgpu tcp beside the raw socket pair, the ratio in ``extra_info``.

    python -m pytest bench/test_transport.py --benchmark-only -p no:cacheprovider

The timed function is rgpu's; ``extra_info`` carries the harness's interleaved comparison
(median of 5 rgpu / raw runs: value, baseline, ratio, spreads) and the target. Not part of
the test suite (``testpaths`` is ``tests``); the targets are checked by reading the ratio.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from rgpu.bench import harness
from rgpu.bench import transport as tb

MiB = 1 << 20


@pytest.fixture(scope="module")
def tcp():
    """The tcp pairs (rgpu through a local ``rgpu serve``, the raw socket baseline), client pinned apart."""
    ctx = tb.Context(argparse.Namespace(server=None))
    before = os.sched_getaffinity(0)
    harness.pin_self(ctx.client_cpus)
    try:
        yield tb.tcp_pairs(ctx)
    finally:
        ctx.close()
        os.sched_setaffinity(0, before)


def _record(benchmark, result: dict, target: str) -> None:
    benchmark.extra_info.update({k: result[k] for k in ("value", "baseline", "ratio", "spread", "baseline_spread",
                                                        "ratio_spread", "runs")})
    benchmark.extra_info["baseline_name"] = "raw socket"
    benchmark.extra_info["target"] = target


def test_tcp_upload_of_64_mib_beside_a_raw_socket(benchmark, tcp):
    rgpu, raw = tcp["bandwidth"]
    src = np.arange(64 * MiB, dtype=np.uint8)
    view, stride = memoryview(src), tb.stride_for(src.nbytes)
    expected = tb.sampled_sum(src, stride)
    result = harness.compare(tb._bandwidth_fn(rgpu, src, 3), tb._bandwidth_fn(raw, src, 3), repeats=5)
    _record(benchmark, result, "ratio >= 0.90 (GB/s)")
    assert benchmark.pedantic(rgpu.upload, args=(view, stride), rounds=10, warmup_rounds=1) == expected


def test_tcp_round_trip_of_64_bytes_beside_a_raw_ping_pong(benchmark, tcp):
    rgpu, raw = tcp["rtt"]
    for b in (rgpu, raw):
        for _ in range(200):
            b.ping()
    result = harness.compare(tb._rtt_fn(rgpu, 2000), tb._rtt_fn(raw, 2000), repeats=5)
    _record(benchmark, result, "ratio <= 1.5 (us)")
    benchmark.pedantic(rgpu.ping, rounds=2000, warmup_rounds=100)
