"""Downloads of GPU tensors answered from one kept pinned buffer (``staging.Readback``), not fresh memory."""
from __future__ import annotations

import pytest
import torch

from rgpu import config
from rgpu.protocol.ops import Msg
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.server.ops.executor import Executor
from rgpu.server.ops.staging import READBACK_MAX_BYTES, READBACK_MIN_BYTES, Readback
from rgpu.server.route import Session

MiB = 1 << 20


def _readback(rc: int = 0):
    calls = []

    def pin(ptr, n):
        calls.append(("pin", n))
        return rc

    return Readback(pin=pin, unpin=lambda ptr: calls.append(("unpin",))), calls


def test_the_download_buffer_grows_to_a_power_of_two_and_is_reused_for_every_smaller_download():
    rb, calls = _readback()
    first = rb.view(3 * MiB)
    first.fill_(5)
    again = rb.view(2 * MiB)            # smaller: the same memory, no new registration
    assert again.numel() == 2 * MiB and again.data_ptr() == first.data_ptr() and calls == [("pin", 4 * MiB)]
    assert bool((again == 5).all())     # the bytes written before are still there: it is one buffer
    bigger = rb.view(5 * MiB)           # grown: the old one unregistered, a new one registered
    assert bigger.numel() == 5 * MiB and calls == [("pin", 4 * MiB), ("unpin",), ("pin", 8 * MiB)]
    rb.close()
    assert calls[-1] == ("unpin",) and rb.host is None


def test_downloads_outside_the_buffers_bounds_are_not_answered_from_it():
    rb, calls = _readback()
    assert rb.view(READBACK_MIN_BYTES - 1) is None and rb.view(READBACK_MAX_BYTES + 1) is None
    assert calls == []


def test_a_download_buffer_that_will_not_pin_is_warned_of_once_and_never_tried_again(caplog):
    rb, calls = _readback(rc=2)
    with caplog.at_level("WARNING", logger="rgpu.server.uploads"):
        assert rb.view(2 * MiB) is None and rb.view(4 * MiB) is None
    assert calls == [("pin", 2 * MiB)] and len(caplog.records) == 1 and rb.host is None


def test_the_cpu_executor_answers_a_download_with_the_tensors_own_bytes_not_the_buffer():
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cpu")))
    n = 2 * MiB // 4
    desc = [1, n * 4, CODE_BY_DTYPE[torch.float32], [n], [1], 0, 0]
    ex.handle([Msg.UPLOAD, [], desc], [memoryview(torch.arange(float(n)).numpy()).cast("B")], False)
    _, bufs = ex.handle([Msg.DOWNLOAD, [], desc], [], True)
    assert torch.equal(torch.frombuffer(bytearray(bufs[0]), dtype=torch.float32), torch.arange(float(n)))
    assert ex.uploads.readback.host is None and ex.uploads.pieces["download kept"] == 0
    ex.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the buffer is written by its DMA")
def test_downloads_of_gpu_tensors_come_back_value_by_value_through_the_kept_buffer():
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cuda")))

    def desc(sid, dtype, n):
        return [sid, n * dtype.itemsize, CODE_BY_DTYPE[dtype], [n], [1], 0, 0]

    sent = {}
    for sid, (dtype, n) in enumerate([(torch.float32, 3 * MiB // 4), (torch.int64, MiB // 8), (torch.uint8, 5 * MiB),
                                      (torch.float16, 100), (torch.float32, 3 * MiB // 4 + 1)], start=1):
        src = (torch.arange(n, dtype=torch.int64) * 7 + sid).to(dtype)
        ex.handle([Msg.UPLOAD, [], desc(sid, dtype, n)], [memoryview(src.numpy()).cast("B")], False)
        sent[sid] = (desc(sid, dtype, n), src)
    for _ in range(2):   # each answer copied out before the next download reuses the buffer
        for d, src in sent.values():
            _, bufs = ex.handle([Msg.DOWNLOAD, [], d], [], True)
            got = torch.frombuffer(bytearray(bufs[0]), dtype=src.dtype)
            assert torch.equal(got, src), f"download of {d} differs at {(got != src).nonzero()[:5].flatten().tolist()}"
    pieces = ex.handle([Msg.UPLOAD_INFO], [], True)[0]["pieces"]
    assert pieces["download kept"] == 2 * 4                    # all but the 200-byte one (plainly)
    assert ex.uploads.readback.host.numel() == 8 * MiB          # grown to the largest, a power of two
    ex.close()
