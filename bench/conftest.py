"""What the pytest-benchmark files here share: the pinned transport context and the two comparisons.

``upload(pairs, target)`` and ``round_trip(pairs, target)`` run the harness's interleaved comparison
of a transport's ``bandwidth`` or ``rtt`` pair into ``benchmark.extra_info`` (with the target, read
rather than asserted), then time rgpu's side alone with ``benchmark.pedantic``.
"""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from rgpu.bench import harness
from rgpu.bench import transport as tb

MiB = 1 << 20


@pytest.fixture(scope="module")
def ctx():
    """A local ``rgpu serve`` and the raw server, this process pinned apart from them."""
    with tb.Context(argparse.Namespace(server=None)) as c, harness.pinned(c.client_cpus):
        yield c


def _record(benchmark, result: dict, baseline: str, target: str) -> None:
    benchmark.extra_info.update({k: result[k] for k in ("value", "baseline", "ratio", "spread", "baseline_spread",
                                                        "ratio_spread", "runs")})
    benchmark.extra_info.update(baseline_name=baseline, target=target)


@pytest.fixture
def upload(benchmark):
    """64 MiB uploads; returns (the receiver's sampled sum of rgpu's last upload, the sum expected)."""
    def run(pairs: dict, target: str) -> tuple[int, int]:
        rgpu, base = pairs["bandwidth"]
        src = np.arange(64 * MiB, dtype=np.uint8)
        view, stride = memoryview(src), tb.stride_for(src.nbytes)
        result = harness.compare(tb._bandwidth_fn(rgpu, src, 3), tb._bandwidth_fn(base, src, 3), repeats=5)
        _record(benchmark, result, base.name, target)
        got = benchmark.pedantic(rgpu.upload, args=(view, stride), rounds=10, warmup_rounds=1)
        return got, tb.sampled_sum(src, stride)
    return run


@pytest.fixture
def round_trip(benchmark):
    """64 B round trips, both sides warmed by 200 pings first."""
    def run(pairs: dict, target: str) -> None:
        rgpu, base = pairs["rtt"]
        for b in (rgpu, base):
            for _ in range(200):
                b.ping()
        result = harness.compare(tb._rtt_fn(rgpu, 2000), tb._rtt_fn(base, 2000), repeats=5)
        _record(benchmark, result, base.name, target)
        benchmark.pedantic(rgpu.ping, rounds=2000, warmup_rounds=100)
    return run
