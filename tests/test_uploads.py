"""Big uploads go in pieces that land at their offsets; small ones and odd destinations go whole."""
from __future__ import annotations

import pytest
import torch
from device_helpers import rgpu_device  # noqa: F401

import rgpu
from rgpu import config
from rgpu.device_backend.transfers import UPLOAD_PIECE_BYTES
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.ops_protocol import Msg
from rgpu.server.routes.base import Session
from rgpu.server.routes.ops import Executor


def test_a_big_upload_goes_in_pieces_and_arrives_whole(rgpu_device):
    src = torch.randn(2 * rgpu_device.transfers.piece_bytes() // 4 + 1000)  # two full pieces and a bit
    torch.rgpu.synchronize()
    rgpu.stats(reset=True)
    dst = src.to("rgpu")
    sent = rgpu.stats()
    assert sent["messages"] == 3 and sent["bytes_out"] == src.numel() * 4, sent
    assert torch.equal(dst.cpu(), src)


def test_later_changes_to_the_source_of_a_big_upload_never_arrive(rgpu_device):
    src = torch.ones(UPLOAD_PIECE_BYTES // 4 * 2)
    dst = src.to("rgpu")
    src.fill_(7.0)
    assert dst.sum().item() == src.numel()


def test_an_upload_into_a_strided_destination_goes_whole(rgpu_device):
    dst = torch.zeros(UPLOAD_PIECE_BYTES // 4, 3).to("rgpu").t()  # not contiguous
    src = torch.arange(3.0 * (UPLOAD_PIECE_BYTES // 4)).view(3, -1)
    torch.rgpu.synchronize()
    rgpu.stats(reset=True)
    dst.copy_(src)
    assert rgpu.stats()["messages"] == 1
    assert torch.equal(dst.cpu(), src)


def _executor() -> Executor:
    return Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cpu")))


def test_pieces_land_at_their_offsets_and_one_past_the_end_is_refused():
    ex = _executor()
    desc = [1, 64, CODE_BY_DTYPE[torch.float32], [16], [1], 0, 0]
    for k in range(4):  # four pieces of four floats, out of order
        piece = torch.full((4,), float(k))
        ex.handle([Msg.UPLOAD_PART, [], desc, k * 16], [memoryview(piece.numpy()).cast("B")], False)
    _, bufs = ex.handle([Msg.DOWNLOAD, [], desc], [], True)
    got = torch.frombuffer(bytearray(bufs[0]), dtype=torch.float32)
    assert torch.equal(got, torch.arange(4.0).repeat_interleave(4))
    with pytest.raises(Exception, match="does not fit"):
        ex.handle([Msg.UPLOAD_PART, [], desc, 60], [memoryview(bytes(8))], False)
    with pytest.raises(Exception, match="byte offset"):
        ex.handle([Msg.UPLOAD_PART, [], desc, -4], [memoryview(bytes(4))], False)


def test_a_shm_segment_is_registered_once_and_unregistered_only_after_the_transport_lets_it_go(monkeypatch):
    import mmap

    import numpy as np

    from rgpu.server.ops.uploads import Pinned

    calls = []

    class Runtime:  # stands in for torch.cuda.cudart() on a machine without a GPU
        def cudaHostRegister(self, base, n, flags):
            calls.append(("register", n))
            return 0

        def cudaHostUnregister(self, base):
            calls.append(("unregister",))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    mapping = mmap.mmap(-1, 1 << 20)
    segment = np.frombuffer(mapping, dtype=np.uint8)  # as the shm transport maps a peer's memfd
    pinned = Pinned()
    first = pinned.view(memoryview(segment[4096:8192]))
    second = pinned.view(memoryview(segment[0:100]))
    assert first.numel() == 4096 and second.numel() == 100 and calls == [("register", 1 << 20)]
    assert pinned.view(memoryview(bytearray(64))) is None  # pool memory (tcp): staged instead
    del first, second
    pinned.forget_dropped()
    assert len(pinned.entries) == 1  # the transport still maps the segment
    segment = None
    pinned.forget_dropped()
    assert calls[-1] == ("unregister",) and not pinned.entries
    mapping.close()  # nothing holds the mapping any more


def test_a_download_into_client_memory_fills_its_range_and_bad_ones_are_refused():
    ex = _executor()
    desc = [1, 64, CODE_BY_DTYPE[torch.float32], [16], [1], 0, 0]
    ex.handle([Msg.UPLOAD, [], desc], [memoryview(torch.arange(16.0).numpy()).cast("B")], False)
    into = bytearray(24)
    assert ex.handle([Msg.DOWNLOAD, [], desc, 8], [memoryview(into)], True) == (None, [])
    assert torch.equal(torch.frombuffer(into, dtype=torch.float32), torch.arange(2.0, 8.0))
    with pytest.raises(Exception, match="outside its"):
        ex.handle([Msg.DOWNLOAD, [], desc, 48], [memoryview(bytearray(24))], True)
    with pytest.raises(Exception, match="writable buffer"):
        ex.handle([Msg.DOWNLOAD, [], desc, 0], [memoryview(bytes(8))], True)
    with pytest.raises(Exception, match="byte offset"):
        ex.handle([Msg.DOWNLOAD, [], desc], [memoryview(bytearray(8))], True)
