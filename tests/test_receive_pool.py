"""On a GPU the frame loop receives big buffers into pinned blocks (``staging.ReceivePool``): a piece goes to
the device by DMA from where it arrived, and its block is leased again only once that copy is done."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rgpu import config
from rgpu.protocol.ops import Msg
from rgpu.server.ops import staging
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.server.ops.executor import Executor
from rgpu.server.route import Session

BLOCK = staging.RECEIVE_BYTES


class Copy:   # stands in for torch.cuda.Event: a copy the test finishes when it says so
    def __init__(self):
        self.finished, self.waited = False, False

    def record(self, stream):
        pass

    def query(self):
        return self.finished

    def synchronize(self):
        self.waited = self.finished = True


def _pool(rc: int = 0):
    pins, copies = [], []

    def event():
        copies.append(Copy())
        return copies[-1]

    pool = staging.ReceivePool(pin=lambda ptr, n: pins.append(n) or rc, event=event, unpin=lambda ptr: None)
    return pool, pins, copies


def _receive(pool, n: int, byte: int):
    """A frame's buffer, leased, filled as the transport would, and handed to a copy that stays pending."""
    view, token = pool.lease(n)
    view[:] = bytes([byte]) * n
    if pool.holds(view) is not None:
        pool.reading(view, None)
    return view, token


def test_a_block_whose_copy_is_pending_is_not_leased_again_until_every_block_is_taken_and_then_is_waited_for():
    pool, pins, copies = _pool()
    first, token = _receive(pool, BLOCK, 1)
    pool.release(token)
    second, token2 = _receive(pool, BLOCK - 5, 2)   # the first block's copy still runs: a second block
    assert second.obj is not first.obj and bytes(first[:1]) == b"\x01" and len(pins) == 2
    pool.release(token2)
    copies[0].finished = True
    third, token3 = pool.lease(BLOCK)              # the oldest free block, its copy done: reused, no wait
    assert third.obj is first.obj and not copies[0].waited and pool.waits == 0
    pool.release(token3)
    pool.reading(third, None)
    for k in range(staging.RECEIVE_BLOCKS - len(pool.blocks)):   # new blocks while others' copies are pending
        pool.release(_receive(pool, BLOCK, 10 + k)[1])
    assert pool.waits == 0 and len(pins) == staging.RECEIVE_BLOCKS
    view, token = _receive(pool, BLOCK, 20)         # every block pending: this lease waited for the oldest's copy
    assert pool.waits == 1 and copies[1].waited and view.obj is second.obj and bytes(view[:1]) == b"\x14"
    assert len(pool.blocks) == staging.RECEIVE_BLOCKS


def test_buffers_of_other_sizes_and_every_one_after_a_failed_registration_come_from_the_plain_pool(caplog):
    pool, pins, _ = _pool()
    small, _ = pool.lease(staging.RECEIVE_MIN_BYTES - 1)
    big, _ = pool.lease(BLOCK + 1)
    assert pool.holds(small) is None and pool.holds(big) is None and pins == []
    failing, pins, _ = _pool(rc=2)
    with caplog.at_level("WARNING", logger="rgpu.server.uploads"):
        a, _ = failing.lease(BLOCK)
        b, _ = failing.lease(BLOCK)
    assert failing.holds(a) is None and failing.holds(b) is None and pins == [BLOCK] and len(caplog.records) == 1


def test_the_cpu_executor_keeps_the_worker_s_plain_receive_buffers():
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cpu")))
    assert ex.receive_pool is None
    ex.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the blocks are pinned and DMA'd from")
def test_pieces_received_into_pinned_blocks_arrive_value_by_value_while_their_blocks_are_reused():
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cuda")))
    pool, n = ex.receive_pool, 3 * BLOCK + (2 << 20)       # four pieces, more than once round the blocks
    src = np.random.default_rng(9).integers(0, 256, n, dtype=np.uint8)
    desc = [1, n, CODE_BY_DTYPE[torch.uint8], [n], [1], 0, 0]
    ex.handle([Msg.UPLOAD, [], desc], [memoryview(np.zeros(n, dtype=np.uint8))], False)
    for _ in range(3):
        for offset in range(0, n, BLOCK):
            piece = src[offset:offset + BLOCK]
            view, token = pool.lease(piece.nbytes)      # as the frame loop's transport leases it
            view[:] = piece.tobytes()
            ex.handle([Msg.UPLOAD_PART, [], desc, offset], [view], False)
            pool.release(token)                        # the frame released: its block pending its copy
    _, bufs = ex.handle([Msg.DOWNLOAD, [], desc], [], True)
    assert np.array_equal(np.frombuffer(bytearray(bufs[0]), dtype=np.uint8), src)
    pieces = ex.handle([Msg.UPLOAD_INFO], [], True)[0]["pieces"]
    assert pieces["dma from received"] == 12 and pieces["staged"] == 0 and len(pool.blocks) <= staging.RECEIVE_BLOCKS
    ex.close()
