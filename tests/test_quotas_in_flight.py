"""Frames in flight (``RGPU_MAX_FRAMES_IN_FLIGHT``): a session that posts past its quota without waiting gets a
clear error at its next wait, the posts past it are not run, and the session goes on (ops and cuda routes)."""
from __future__ import annotations

import numpy as np
import pytest

from rgpu.errors import RemoteError

from test_resilience_tenants import cuda, cuda_context, download, upload

CAP = 4


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    from conftest import RunningServer

    server = RunningServer(tmp_path_factory.mktemp("in-flight"), ["--device", "cpu", "--cuda-driver", "fake"],
                           env={"RGPU_MAX_FRAMES_IN_FLIGHT": str(CAP)})
    yield server
    server.stop()


def test_ops_posts_past_the_frames_in_flight_fail_naming_the_setting_and_the_session_goes_on(capped):
    conn = capped.connect("ops")
    for sid in range(1, CAP + 3):                       # two past the quota
        upload(conn, sid, np.full(16, sid, dtype=np.float32))
    with pytest.raises(RemoteError, match=f"RGPU_MAX_FRAMES_IN_FLIGHT.*quota of {CAP}") as failed:
        download(conn, 1, 16)
    assert failed.value.remote_type == "QuotaExceeded"
    for sid in range(1, CAP + 1):                       # those within it ran, once
        assert np.array_equal(download(conn, sid, 16), np.full(16, sid, dtype=np.float32))
    upload(conn, CAP + 1, np.ones(16, dtype=np.float32))   # a wait counted afresh: room again
    assert np.array_equal(download(conn, CAP + 1, 16), np.ones(16, dtype=np.float32))


def test_cuda_posts_past_the_frames_in_flight_fail_naming_the_setting_and_the_session_goes_on(capped):
    conn = capped.connect("cuda")
    ctx = cuda_context(conn)
    ptrs = [cuda(conn, "mem_alloc", ctx, 64)[1] for _ in range(CAP + 1)]
    for i, ptr in enumerate(ptrs):                      # posted: no answer waited for
        conn.post(["memcpy_htod", ctx, ptr, None], [bytes([i + 1]) * 64])
    with pytest.raises(RemoteError, match="RGPU_MAX_FRAMES_IN_FLIGHT"):
        conn.call(["memcpy_dtoh", ctx, ptrs[0], 64, None])
    for i, ptr in enumerate(ptrs[:CAP]):
        code, _ = cuda(conn, "ctx_synchronize", ctx)
        reply = conn.call(["memcpy_dtoh", ctx, ptr, 64, None])
        assert reply.meta[0] == 0 and bytes(reply.buffers[0]) == bytes([i + 1]) * 64
        reply.release()
    reply = conn.call(["memcpy_dtoh", ctx, ptrs[CAP], 64, None])
    assert bytes(reply.buffers[0]) != bytes([CAP + 1]) * 64  # the post past the quota never ran
    reply.release()
