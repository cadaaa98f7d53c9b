"""Tenants of one server: a session's device memory quota on both routes, and its handles its own.

Raw protocol clients (the ops route's and the cuda route's messages over a connection, no torch client),
against a real ``rgpu serve`` (the cpu executor, the fake CUDA driver)."""
from __future__ import annotations

import numpy as np
import pytest

from rgpu.errors import RemoteError
from rgpu.protocol.ops import DTYPES, Event, Msg

F32 = DTYPES.index("float32")
QUOTA = 1 << 20
CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY = 0, 2


def desc(sid: int, n: int) -> list:
    return [sid, 4 * n, F32, [n], [1], 0, 0]


def upload(conn, sid: int, values: np.ndarray) -> None:
    conn.post([Msg.UPLOAD, [], desc(sid, values.size)], [values.astype(np.float32)])


def download(conn, sid: int, n: int) -> np.ndarray:
    reply = conn.call([Msg.DOWNLOAD, [], desc(sid, n)])
    out = np.frombuffer(bytes(reply.buffers[0]), dtype=np.float32)
    reply.release()
    return out


def cuda(conn, op: str, ctx: int, *args, buffers=()):
    """One cuda route call: (CUresult, value or message)."""
    code, value, _deferred = conn.call([op, ctx, *args], list(buffers)).meta
    return code, value


def cuda_context(conn) -> int:
    assert cuda(conn, "init", 0, 0)[0] == CUDA_SUCCESS
    code, ctx = cuda(conn, "primary_ctx_retain", 0, 0)
    assert code == CUDA_SUCCESS
    return ctx


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory):
    from conftest import RunningServer

    server = RunningServer(tmp_path_factory.mktemp("quota-server"), ["--device", "cpu", "--cuda-driver", "fake"],
                           env={"RGPU_MAX_SESSION_BYTES": str(QUOTA)})
    yield server
    server.stop()


def test_an_upload_past_the_session_quota_fails_naming_the_setting_and_the_session_goes_on(quota_server):
    conn = quota_server.connect("ops")
    half = np.arange(QUOTA // 8, dtype=np.float32)      # half the quota
    upload(conn, 1, half)
    upload(conn, 2, half * 2)                           # the quota, exactly
    upload(conn, 3, np.ones(16, dtype=np.float32))      # past it
    with pytest.raises(RemoteError, match=f"RGPU_MAX_SESSION_BYTES.*quota of {QUOTA} bytes") as failed:
        download(conn, 1, half.size)
    assert failed.value.remote_type == "QuotaExceeded"
    assert np.array_equal(download(conn, 2, half.size), half * 2)   # the session goes on, its storages intact
    conn.post([Msg.EVENTS, [Event.FREE, 1]])
    upload(conn, 3, np.ones(16, dtype=np.float32))      # room again
    assert np.array_equal(download(conn, 3, 16), np.ones(16, dtype=np.float32))


def test_a_cuda_allocation_past_the_session_quota_is_out_of_memory_naming_the_setting(quota_server):
    conn = quota_server.connect("cuda")
    ctx = cuda_context(conn)
    code, first = cuda(conn, "mem_alloc", ctx, QUOTA // 2)
    assert code == CUDA_SUCCESS
    code, message = cuda(conn, "mem_alloc", ctx, QUOTA)
    assert code == CUDA_ERROR_OUT_OF_MEMORY and "RGPU_MAX_SESSION_BYTES" in message
    assert cuda(conn, "mem_free", ctx, first)[0] == CUDA_SUCCESS
    code, again = cuda(conn, "mem_alloc", ctx, QUOTA)   # its memory back: the whole quota fits
    assert code == CUDA_SUCCESS
    assert cuda(conn, "memcpy_htod", ctx, again, None, buffers=[b"x" * 64])[0] == CUDA_SUCCESS


def test_a_session_that_names_another_sessions_storage_id_never_sees_its_bytes(quota_server):
    owner, other = quota_server.connect("ops"), quota_server.connect("ops")
    secret = np.full(256, 7.25, dtype=np.float32)
    upload(owner, 42, secret)
    assert np.array_equal(download(owner, 42, 256), secret)
    seen = download(other, 42, 256)      # the other session's id 42 is a storage of its own
    assert not np.array_equal(seen, secret)
    upload(other, 42, np.zeros(256, dtype=np.float32))
    assert np.array_equal(download(owner, 42, 256), secret)   # and writing it leaves the owner's alone


def test_a_cuda_session_that_names_another_sessions_device_pointer_is_refused(quota_server):
    owner, other = quota_server.connect("cuda"), quota_server.connect("cuda")
    ctx = cuda_context(owner)
    code, ptr = cuda(owner, "mem_alloc", ctx, 4096)
    assert code == CUDA_SUCCESS
    assert cuda(owner, "memcpy_htod", ctx, ptr, None, buffers=[b"s" * 4096])[0] == CUDA_SUCCESS
    their_ctx = cuda_context(other)
    code, _ = cuda(other, "memcpy_dtoh", their_ctx, ptr, 4096, None)
    assert code != CUDA_SUCCESS
    code, _ = cuda(other, "mem_free", their_ctx, ptr)
    assert code != CUDA_SUCCESS
    code, _ = cuda(owner, "memcpy_dtoh", ctx, ptr, 4096, None)
    assert code == CUDA_SUCCESS
