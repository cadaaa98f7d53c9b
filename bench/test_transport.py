"""pytest-benchmark over the transport harness: rgpu tcp beside the raw socket pair, the ratio in ``extra_info``.

    python -m pytest bench/test_transport.py --benchmark-only -p no:cacheprovider

The timed function is rgpu's; ``extra_info`` carries the harness's interleaved comparison
(median of 5 rgpu / raw runs: value, baseline, ratio, spreads) and the target. Not part of
the test suite (``testpaths`` is ``tests``); the targets are checked by reading the ratio.
"""
from __future__ import annotations

import pytest

from rgpu.bench import transport as tb


@pytest.fixture(scope="module")
def tcp(ctx):
    """The tcp pairs: rgpu through a local ``rgpu serve``, the raw socket baseline."""
    return tb.tcp_pairs(ctx)


def test_tcp_upload_of_64_mib_beside_a_raw_socket(upload, tcp):
    got, expected = upload(tcp, "ratio >= 0.90 (GB/s)")
    assert got == expected


def test_tcp_round_trip_of_64_bytes_beside_a_raw_ping_pong(round_trip, tcp):
    round_trip(tcp, "ratio <= 1.5 (us)")
