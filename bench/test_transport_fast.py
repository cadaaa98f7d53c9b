"""pytest-benchmark over the transport harness: shm and ucx beside their baselines, the ratio in ``extra_info``.

    python -m pytest bench/test_transport_fast.py --benchmark-only -p no:cacheprovider

Targets: shm upload of 64 MiB >= 0.80 of one-thread ``numpy.copyto``; shm 64 B round trip
<= 0.20 of rgpu's tcp; ucx upload of 64 MiB >= 0.90 of raw UCXX (worker-address endpoints).
The timed function is rgpu's; ``extra_info`` carries the interleaved comparison (median of 5).
Not part of the test suite (``testpaths`` is ``tests``); the targets are read, not asserted.
"""
from __future__ import annotations

import pytest

from rgpu.bench import transport as tb
from rgpu.bench import transport_fast as fast

needs_shm = pytest.mark.skipif("shm" not in tb.TRANSPORTS, reason="shm is not available here")


@needs_shm
def test_shm_upload_of_64_mib_beside_one_thread_copyto(upload, ctx):
    got, expected = upload(fast.shm_pairs(ctx), "ratio >= 0.80 (GB/s)")
    assert got == expected


@needs_shm
def test_shm_round_trip_of_64_bytes_beside_rgpu_tcp(round_trip, ctx):
    round_trip(fast.shm_pairs(ctx), "ratio <= 0.20 (us)")


@pytest.mark.skipif("ucx" not in tb.TRANSPORTS, reason="UCXX is not installed (pip install 'rgpu[ucx]')")
def test_ucx_upload_of_64_mib_beside_raw_ucxx(upload, ctx):
    got, expected = upload(fast.ucx_pairs(ctx), "ratio >= 0.90 (GB/s)")
    assert got == expected
