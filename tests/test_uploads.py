"""Big uploads go in pieces that land at their offsets; small ones and odd destinations go whole."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from device_helpers import rgpu_device  # noqa: F401

import rgpu
from rgpu import config
from rgpu.device_backend.transfers import UPLOAD_PIECE_BYTES
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.protocol.ops import Msg
from rgpu.server.route import Session
from rgpu.server.ops.executor import Executor


def test_a_big_upload_goes_in_pieces_and_arrives_whole(rgpu_device):
    src = torch.randn(2 * rgpu_device.transfers.piece_bytes() // 4 + 1000)  # two full pieces and a bit
    torch.rgpu.synchronize()
    rgpu.stats(reset=True)
    dst = src.to("rgpu")
    sent = rgpu.stats()
    assert sent["messages"] == 3 and sent["bytes_out"] == src.numel() * 4, sent
    assert torch.equal(dst.cpu(), src)


def test_later_changes_to_the_source_of_a_big_upload_never_arrive(rgpu_device):
    src = torch.ones(rgpu_device.transfers.piece_bytes() // 4 * 2)
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

    from rgpu.server.ops.staging import Pinned

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


# ---- whole uploads to a GPU: the pinned ring -----------------------------------------------------

class _Gpu:
    """A stream that runs copies only when told to: a ring that reused a span too early spoils a pending copy.
    Its memory is numpy arrays (as fast with the rgpu client imported in this process as without)."""

    def __init__(self):
        self.queue = []

    def send(self, dst, host, done):
        done.finished = False
        self.queue.append((dst, host, done))

    def run(self, count=None, until=None):
        """The oldest ``count`` queued copies (all by default), or those up to ``until``'s."""
        while self.queue and count != 0:
            dst, host, done = self.queue.pop(0)
            np.copyto(dst, host.numpy())
            done.finished = True
            count = None if count is None else count - 1
            if done is until:
                return


class _Event:
    def __init__(self, gpu: _Gpu):
        self.gpu, self.finished = gpu, True

    def query(self):
        return self.finished

    def synchronize(self):
        if not self.finished:
            self.gpu.run(until=self)


def _ring(nbytes=4096):
    from rgpu.server.ops.staging import Ring

    gpu = _Gpu()
    made = []

    def event():
        made.append(_Event(gpu))
        return made[-1]
    return Ring(nbytes, event=event, send=gpu.send), gpu, made


def _put(ring, n: int, seed: int):
    src = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    assert ring.put(dst, memoryview(src))
    return src, dst


def _spans(ring):
    return [start % ring.bytes.nbytes for start, _ in ring.pending]


def test_the_ring_hands_out_aligned_spans_front_to_back_and_waits_for_the_oldest_copy_only_when_full():
    ring, gpu, _ = _ring()
    sent = [_put(ring, 1000, k) for k in range(4)]
    assert _spans(ring) == [0, 1024, 2048, 3072] and ring.waits == 0 and len(gpu.queue) == 4
    sent.append(_put(ring, 1000, 4))  # full of pending copies: the oldest one must run first
    assert ring.waits == 1 and len(gpu.queue) == 4 and _spans(ring) == [1024, 2048, 3072, 0]
    gpu.run()
    assert all(np.array_equal(dst, src) for src, dst in sent)


def test_a_span_that_would_cross_the_end_starts_over_at_the_front_once_that_is_free():
    ring, gpu, _ = _ring()
    first = _put(ring, 3000, 0)
    gpu.run()
    second = _put(ring, 2000, 1)  # 3072 + 2000 would cross 4096; the front's copy is done: no wait
    assert _spans(ring) == [0] and ring.waits == 0
    third = _put(ring, 2000, 2)
    assert _spans(ring) == [0, 2048] and ring.waits == 0
    fourth = _put(ring, 100, 3)  # the ring is full at 4096: wraps, and waits for the copy at 0
    assert _spans(ring) == [2048, 0] and ring.waits == 1
    gpu.run()
    assert all(np.array_equal(dst, src) for src, dst in (first, second, third, fourth))


def test_finished_copies_give_back_their_space_and_their_events_without_waiting():
    ring, gpu, made = _ring()
    for k in range(40):  # ten times round the ring, each copy done before the next upload
        src, dst = _put(ring, 1000, k)
        gpu.run()
        assert np.array_equal(dst, src)
    assert ring.waits == 0 and len(made) <= 5  # events of finished copies are recorded again


def test_an_upload_bigger_than_the_ring_is_refused_and_leaves_it_untouched():
    ring, gpu, made = _ring()
    assert not ring.put(np.zeros(4097, dtype=np.uint8), memoryview(bytes(4097)))
    assert not ring.pending and not gpu.queue and not made and ring.head == 0
    src, dst = _put(ring, 4096, 0)  # exactly the ring's size fits
    gpu.run()
    assert np.array_equal(dst, src)


def test_uploads_of_random_sizes_arrive_whole_however_far_behind_the_gpu_runs():
    import random

    rng = random.Random(7)
    ring, gpu, _ = _ring(1 << 16)
    sent = []
    for k in range(2000):
        sent.append(_put(ring, rng.choice([1, 7, 255, 256, 257, rng.randint(1, 1 << 14), 1 << 16]), k))
        gpu.run(count=rng.choice([0, 0, 1, 2, 5]))  # the GPU falls behind, then catches up a little
    gpu.run()
    assert ring.waits > 0 and ring.head > 50 * (1 << 16)  # full at times, round many times
    bad = [k for k, (src, dst) in enumerate(sent) if not np.array_equal(dst, src)]
    assert not bad, f"uploads {bad[:10]} arrived spoiled"


def test_a_ring_that_will_not_pin_is_warned_of_once_and_whole_uploads_are_copied_plainly(monkeypatch, caplog):
    import contextlib

    from rgpu.server.ops.uploads import Uploads

    calls = []

    class Runtime:  # cudaHostRegister failing, as on a host that refuses to lock more memory
        def cudaHostRegister(self, base, n, flags):
            calls.append(n)
            return 2

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    uploads = Uploads(None, True)
    with caplog.at_level("WARNING", logger="rgpu.server.uploads"):
        assert uploads._ring(torch.device("cuda", 0)) is None
        assert uploads._ring(torch.device("cuda", 0)) is None and uploads._ring(torch.device("cuda", 1)) is None
    assert len(calls) == 1 and len([r for r in caplog.records if "ring" in r.getMessage()]) == 1


def test_the_cpu_executor_copies_whole_uploads_plainly_and_makes_no_ring():
    ex = _executor()
    desc = [1, 64, CODE_BY_DTYPE[torch.float32], [16], [1], 0, 0]
    ex.handle([Msg.UPLOAD, [], desc], [memoryview(torch.arange(16.0).numpy()).cast("B")], False)
    _, bufs = ex.handle([Msg.DOWNLOAD, [], desc], [], True)
    assert torch.equal(torch.frombuffer(bytearray(bufs[0]), dtype=torch.float32), torch.arange(16.0))
    assert ex.uploads.rings == {} and ex.uploads.pieces["whole by ring"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the ring stages uploads to one")
@pytest.mark.parametrize("server_c", [False, True], ids=["the Python ring", "C++ and the host allocator"])
def test_many_small_uploads_arrive_value_by_value_on_a_gpu_with_compute_between_them(server_c):
    import random

    from rgpu.protocol.ops import Event
    from rgpu.server.ops import fast_op
    from rgpu.server.ops.staging import RING_BYTES

    if server_c and fast_op.load() is None:
        pytest.skip(f"no C++ op path here: {fast_op.why_not()}")
    ex = Executor(Session(id="t", route="ops", settings=config.settings(environ={}, device="cuda", server_c=server_c)))
    for index, op in enumerate((torch.ops.aten.add.Tensor, torch.ops.aten.mm.default)):
        ex.handle([Msg.DEFINE, index, f"{op._schema.name[6:]}.{op._overloadname}", str(op._schema)], [], False)

    def desc(sid, dtype, shape, stride=(1,)):
        n = 1
        for s in shape:
            n *= s
        return [sid, n * dtype.itemsize, CODE_BY_DTYPE[dtype], list(shape), list(stride), 0, 0]

    def upload(d, src):
        ex.handle([Msg.UPLOAD, [], d], [memoryview(src.contiguous().numpy()).cast("B")], False)

    def download(d, dtype):
        _, bufs = ex.handle([Msg.DOWNLOAD, [], d], [], True)
        return torch.frombuffer(bytearray(bufs[0]), dtype=dtype)

    big = desc(1, torch.float32, [4096, 4096], [4096, 1])
    upload(big, torch.randn(4096, 4096) / 64)  # 64 MiB: bigger than the ring, through the slots
    rng = random.Random(3)
    dtypes = (torch.int64, torch.float32, torch.uint8, torch.int16)
    sent, sums = {}, {}
    for k in range(600):
        if k % 60 == 0:  # the GPU busy for a while: the ring fills with copies still waiting their turn
            torch.cuda._sleep(20_000_000)   # ~10 ms of the GPU's clock: the copies queue up behind it
            for _ in range(4):
                ex.handle([Msg.OP, [], 1, [{"t": big}, {"t": big}], {}, [desc(2, torch.float32, [4096, 4096],
                                                                               [4096, 1])]], [], False)
        dtype = dtypes[k % len(dtypes)]
        n = rng.choice([1, 3, 1000, rng.randint(1, 40_000), 65_536])
        src = (torch.arange(n, dtype=torch.int64) * 7 + k).to(dtype)
        d = desc(1000 + k, dtype, [n])
        if k % 3 == 0:  # a later upload replaces an earlier one, both copies pending
            upload(d, src + 1)
        upload(d, src)
        sent[d[0]] = (d, src)
        if k % 5 == 0:  # an upload freed at once: its copy still runs, before any reuse of its memory
            upload(desc(5000, dtype, [n]), src)
            ex.handle([Msg.EVENTS, [Event.FREE, 5000]], [], False)
        if k % 7 == 0 and dtype is torch.float32:  # an op reads the upload right after it
            out = desc(3000 + k, dtype, [n])
            ex.handle([Msg.OP, [], 0, [{"t": d}, {"t": d}], {}, [out]], [], False)
            sums[k] = (out, src + src)
    strided = desc(4000, torch.float32, [300, 200], [1, 300])  # not contiguous: copied plainly
    upload(strided, torch.arange(60_000.0).view(300, 200))
    for d, src in sent.values():
        got = download(d, src.dtype)
        assert torch.equal(got, src), f"upload into {d} differs at {(got != src).nonzero()[:5].flatten().tolist()}"
    for out, want in sums.values():
        assert torch.equal(download(out, torch.float32), want)
    got = download([4000, 240_000, CODE_BY_DTYPE[torch.float32], [200, 300], [300, 1], 0, 0], torch.float32)
    assert torch.equal(got.view(200, 300).t(), torch.arange(60_000.0).view(300, 200))
    pieces = ex.handle([Msg.UPLOAD_INFO], [], True)[0]["pieces"]
    in_cpp = pieces["whole in C++"]
    assert pieces["whole by ring"] + in_cpp == 600 + 200 + 120 and in_cpp == (600 + 200 + 120) * server_c
    assert pieces["whole staged"] == 1 and pieces["whole plain"] == 1     # bigger than the ring; strided
    # how often the ring was full depends on the GPU's pace against this host's: the waits themselves are
    # tested above with a GPU whose queue the test drives (test_the_ring_hands_out_aligned_spans...)
    assert sum(src.numel() * src.element_size() for _, src in sent.values()) > 3 * RING_BYTES  # round several times
    ex.uploads.close()
    ex.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: its registrations are being tested")
def test_a_registration_that_fails_does_not_fail_the_next_op_on_a_gpu():
    import mmap

    from rgpu.server.ops.staging import pin

    mapping = mmap.mmap(-1, 1 << 20)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    try:
        assert pin(host.data_ptr(), 1 << 20) == 0
        assert pin(host.data_ptr(), 1 << 20) != 0       # already registered: CUDA's last error is set
        x = torch.ones(4, device="cuda") * 2            # torch's launch check must not find that error
        assert torch.equal(x.cpu(), torch.full((4,), 2.0))
    finally:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
