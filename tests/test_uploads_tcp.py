"""Big uploads over tcp: pieces kept by reference in the replay log (never copied), the last one answered."""
from __future__ import annotations

import socket
import time

import numpy as np
import torch
from device_helpers import rgpu_device, run_python  # noqa: F401

import rgpu
from rgpu.transport.replay_log import ReplayLog
from rgpu.transport.wire import Held, MsgKind, encode_prefix, held

from session_proxy import Cut, CuttingProxy


def _frame(kind: MsgKind, seq: int, *bufs) -> list:
    return [encode_prefix(kind, seq, 0, b"", [memoryview(b).nbytes for b in bufs]), *bufs]


def test_the_replay_log_keeps_held_memory_by_reference_alone_or_in_a_batch_and_copies_the_callers():
    log = ReplayLog(1 << 20, 64)
    alone, mine, theirs, asked = bytearray(b"a" * 100), bytearray(b"b" * 100), bytearray(b"c" * 100), bytearray(b"d" * 9)
    log.add(_frame(MsgKind.POST, 1, held(memoryview(alone))))        # one frame (a piece written alone)
    log.add(_frame(MsgKind.POST, 2, held(memoryview(mine))) + _frame(MsgKind.POST, 3, memoryview(theirs))
            + _frame(MsgKind.REQUEST, 4, held(memoryview(asked))))  # a batch
    for buf, byte in ((alone, b"A"), (mine, b"B"), (theirs, b"C"), (asked, b"D")):
        buf[:] = byte * len(buf)   # changed after the sends returned
    again = log.after(0)
    bufs = [bytes(p) for p in again if len(p) in (100, 9)]
    # held memory is replayed as it is now (a reference: its owner waits for the acknowledgement itself);
    # the caller's other memory as it was sent (a copy)
    assert bufs == [b"A" * 100, b"B" * 100, b"c" * 100, b"D" * 9]
    assert type(held(memoryview(alone))[10:20].obj) is Held   # a piece of a held view is held too


def test_a_big_upload_over_tcp_returns_once_the_server_has_every_piece_and_later_changes_never_arrive(rgpu_device):
    assert rgpu_device.conn.transport_name == "tcp"
    piece = rgpu_device.transfers.piece_bytes()
    src = torch.from_numpy(np.random.default_rng(5).standard_normal(2 * piece // 4 + 1000).astype(np.float32))
    expected = src.clone()
    torch.rgpu.synchronize()
    rgpu.stats(reset=True)
    dst = src.to("rgpu")
    sent = rgpu.stats()
    # three pieces: two posts, then the last one as a request, whose answer says the server has them all
    assert sent["messages"] == 3 and sent["round_trips"] == 1, sent
    src.fill_(7.0)    # a drop and a replay now could only send what the server already has
    assert torch.equal(dst.cpu(), expected)


def test_a_non_blocking_upload_from_pinned_memory_waits_for_nothing_and_arrives_by_the_synchronize(rgpu_device):
    piece = rgpu_device.transfers.piece_bytes()
    src = torch.arange(piece // 4 + 3, dtype=torch.float32).pin_memory()
    dst = torch.empty_like(src, device="rgpu")
    torch.rgpu.synchronize()
    rgpu.stats(reset=True)
    dst.copy_(src, non_blocking=True)
    assert rgpu.stats()["round_trips"] == 0
    torch.rgpu.synchronize()
    assert torch.equal(dst.cpu(), torch.arange(piece // 4 + 3, dtype=torch.float32))


def test_each_transport_gets_its_piece_size_and_tcp_bigger_ones_than_the_default():
    from types import SimpleNamespace

    from rgpu.device_backend import transfers

    def piece(name: str, shared: bool = False) -> int:
        return transfers.Transfers.piece_bytes(SimpleNamespace(s=SimpleNamespace(conn=SimpleNamespace(
            transport_name=name))), shared)

    assert piece("tcp") == transfers.TCP_PIECE_BYTES > transfers.UPLOAD_PIECE_BYTES
    assert piece("shm") == transfers.SHM_PIECE_BYTES and piece("ucx") == transfers.UPLOAD_PIECE_BYTES
    assert piece("shm", shared=True) == transfers.SHARED_PIECE_BYTES


CUT_UPLOAD = r'''
import hashlib
import numpy as np, rgpu, torch
from rgpu.device_backend import session, transfers
n = (2 * transfers.TCP_PIECE_BYTES + 4096) // 4   # three pieces
src = torch.from_numpy(np.random.default_rng(11).standard_normal(n).astype(np.float32))
expected = hashlib.sha256(src.numpy().tobytes()).hexdigest()
dst = src.to("rgpu")
src.fill_(7.0)   # once the upload returned: a replay must not send this
print("same", hashlib.sha256(dst.cpu().numpy().tobytes()).hexdigest() == expected, flush=True)
print("resumes", session.current().conn.transport.resumes, flush=True)
'''


def test_a_big_upload_cut_mid_piece_resumes_and_arrives_as_it_was_when_the_upload_began(start_server):
    server = start_server("--device", "cpu", "--spare-workers", "1", "--preload", "torch",
                          env={"RGPU_SESSION_GRACE": "30"})
    # mid the second piece, both sides reset: the client is blocked writing the piece (a cut that only shuts the
    # proxy's ends leaves that write waiting for the kernel's timeout, past the server's grace)
    proxy = CuttingProxy((server.host, server.port), {0: Cut("up", kind=MsgKind.POST, min_bytes=1 << 20, nth=2,
                                                             fraction=0.5, reset=True)})
    try:
        done = run_python(CUT_UPLOAD, env={"RGPU_SERVER": proxy.address, "RGPU_TOKEN": server.token,
                                           "RGPU_TRANSPORT": "tcp", "RGPU_TCP_STREAMS": "1"}, timeout=120)
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same True" in done.stdout and "resumes 1" in done.stdout, done.stdout
    assert len(proxy.cuts_done) == 1


def test_a_write_blocked_on_a_link_gone_silent_gives_up_within_half_the_grace_and_resumes(start_server):
    # the proxy only shuts its ends (no reset, as a link gone dead leaves them): the client's write of the piece
    # blocks on a peer that no longer reads; TCP_USER_TIMEOUT at half the 12 s grace ends it in time to resume
    server = start_server("--device", "cpu", "--spare-workers", "1", "--preload", "torch",
                          env={"RGPU_SESSION_GRACE": "12"})
    proxy = CuttingProxy((server.host, server.port), {0: Cut("up", kind=MsgKind.POST, min_bytes=1 << 20, nth=2,
                                                             fraction=0.5)})
    start = time.monotonic()
    try:
        done = run_python(CUT_UPLOAD, env={"RGPU_SERVER": proxy.address, "RGPU_TOKEN": server.token,
                                           "RGPU_TRANSPORT": "tcp", "RGPU_TCP_STREAMS": "1"}, timeout=120)
    finally:
        proxy.close()
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same True" in done.stdout and "resumes 1" in done.stdout, done.stdout
    assert len(proxy.cuts_done) == 1
    assert took < 50, took    # not the kernel's 60 s (the old timeout, past the grace)


def test_a_silent_link_is_given_up_on_within_half_the_sessions_grace():
    from rgpu.transport import resume, tcp

    assert resume.dead_after(120.0) == tcp.DEAD_AFTER_S == 60.0      # the default grace: the kernel's minute
    assert resume.dead_after(12.0) == 6.0 and resume.dead_after(1.0) == 2.0
    sock = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(sock.getsockname())
    try:
        tcp.tune(client, 6.0)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 3
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
    finally:
        client.close()
        sock.close()
