"""The ops executor's fast path: cached views of storages stay exact through frees, growth, views and in-place ops.

Each test drives an in-process executor and a CPU mirror of every storage with the same
ops, then compares every storage's bytes (``Mirror.check``).
"""
from __future__ import annotations

import pytest
import torch
from device_helpers import op_path, ops_settings  # noqa: F401  (op_path: every test on both op paths)

from rgpu.protocol.ops import Event, Msg
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.server.ops.handles import MAX_VIEWS
from rgpu.server.route import OpFailed, Session
from rgpu.server.ops.executor import Executor

aten = torch.ops.aten
U8 = CODE_BY_DTYPE[torch.uint8]


class V:
    """A tensor argument: ``size``/``stride``/``offset`` (elements) of storage ``sid``."""

    def __init__(self, sid, size, stride=None, offset=0, dtype=torch.float32):
        if stride is None:
            stride = [1] * len(size)
            for i in range(len(size) - 2, -1, -1):
                stride[i] = stride[i + 1] * size[i + 1]
        self.sid, self.size, self.stride, self.offset, self.dtype = sid, list(size), list(stride), offset, dtype


class Mirror:
    """An executor and a CPU copy of every storage, driven op for op."""

    def __init__(self):
        s = ops_settings()
        self.ex = Executor(Session(id="t", route="ops", settings=s))
        self.cpu: dict[int, torch.Tensor] = {}  # sid -> uint8 bytes
        self.index: dict = {}
        self.events: list[int] = []

    def desc(self, v: V) -> list:
        return [v.sid, self.cpu[v.sid].numel(), CODE_BY_DTYPE[v.dtype], v.size, v.stride, v.offset, 0]

    def tensor(self, v: V) -> torch.Tensor:
        return torch.empty(0, dtype=v.dtype).set_(self.cpu[v.sid].untyped_storage(), v.offset, v.size, v.stride)

    def new(self, sid: int, values, dtype=torch.float32) -> None:
        data = torch.tensor(values, dtype=dtype)
        self.cpu[sid] = data.view(torch.uint8).clone()
        self.ex.handle([Msg.UPLOAD, self._drain(), self.desc(V(sid, [data.numel()], dtype=dtype))],
                       [memoryview(data.numpy()).cast("B")], False)

    def free(self, sid: int) -> None:
        self.events += [Event.FREE, sid]
        del self.cpu[sid]

    def grow(self, dst: int, src: int, nbytes: int) -> None:
        count = self.cpu[src].numel()
        self.events += [Event.COPY, dst, nbytes, 0, src, count, Event.FREE, src]
        self.cpu[dst] = torch.zeros(nbytes, dtype=torch.uint8)
        self.cpu[dst][:count] = self.cpu.pop(src)

    def _drain(self) -> list:
        events, self.events = self.events, []
        return events

    def _wire(self, x):
        if isinstance(x, V):
            return {"t": self.desc(x)}
        return [self._wire(y) for y in x] if isinstance(x, list) else x

    def _local(self, x):
        if isinstance(x, V):
            return self.tensor(x)
        return [self._local(y) for y in x] if isinstance(x, list) else x

    def op(self, op, *args, call: bool = False, **kwargs):
        """Run ``op`` on both sides; a V naming a storage not seen yet makes it (``nbytes`` its span)."""
        for v in [*args, *kwargs.values()]:
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, V) and x.sid not in self.cpu:
                    span = 1 + sum((n - 1) * s for n, s in zip(x.size, x.stride)) + x.offset
                    self.cpu[x.sid] = torch.zeros(span * x.dtype.itemsize, dtype=torch.uint8)
        if op not in self.index:
            self.index[op] = len(self.index) + 1
            name = f"{op._schema.name[6:]}.{op._overloadname}"
            self.ex.handle([Msg.DEFINE, self.index[op], name, str(op._schema)], [], False)
        wire = [self._wire(a) for a in args], {k: self._wire(v) for k, v in kwargs.items()}
        if call:
            self.ex.handle([Msg.CALL, self._drain(), self.index[op], *wire, 1000, 64], [], True)
        else:
            self.ex.handle([Msg.OP, self._drain(), self.index[op], *wire, None], [], False)
        op(*[self._local(a) for a in args], **{k: self._local(v) for k, v in kwargs.items()})

    def check(self) -> None:
        """Every storage's bytes on the executor equal the CPU's."""
        for sid, data in self.cpu.items():
            _, bufs = self.ex.handle([Msg.DOWNLOAD, self._drain(), [sid, data.numel(), U8, [data.numel()], [1], 0, 0]],
                                     [], True)
            assert bytes(bufs[0]) == data.numpy().tobytes(), f"storage {sid} differs"


def test_a_chain_of_ops_each_reading_the_last_output_matches_the_cpu():
    m = Mirror()
    m.new(1, [1.0, 2.0, 3.0, 4.0])
    for sid in range(2, 40):
        m.op(aten.add.out, V(sid - 1, [4]), 1.5, out=V(sid, [4]))
        if sid > 2:
            m.free(sid - 1)
    m.check()


def test_a_freed_id_used_again_names_the_new_storage_not_the_old_view():
    m = Mirror()
    m.new(5, [1.0, 2.0, 3.0, 4.0])
    m.op(aten.mul.out, V(5, [4]), 2.0, out=V(6, [4]))  # caches 5's view
    m.free(5)
    m.new(5, [10.0, 20.0, 30.0, 40.0])  # the same id, the same descriptor, other bytes
    m.op(aten.mul.out, V(5, [4]), 2.0, out=V(7, [4]))
    m.free(5)
    m.new(5, [3, 4], dtype=torch.int64)  # the same id, another dtype and size
    m.op(aten.add.out, V(5, [2], dtype=torch.int64), 1, out=V(8, [2], dtype=torch.int64))
    m.check()


def test_a_grown_storage_is_read_through_its_new_id_with_the_old_bytes():
    m = Mirror()
    m.new(10, [1.0, 2.0, 3.0, 4.0])
    m.op(aten.neg.out, V(10, [4]), out=V(11, [4]))  # caches 10's view
    m.grow(12, 10, 32)
    m.op(aten.fill_.Scalar, V(12, [4], offset=4), 7.0)
    m.op(aten.mul.out, V(12, [8]), 3.0, out=V(13, [8]))
    m.op(aten.add_.Scalar, V(12, [4]), 1.0)
    m.check()


def test_views_of_views_and_in_place_ops_on_them_match_the_cpu():
    m = Mirror()
    m.new(20, [float(i) for i in range(12)])
    whole, rows = V(20, [3, 4]), V(20, [2, 4], offset=4)
    column, transposed, broadcast = V(20, [3], [4], 1), V(20, [4, 3], [1, 4]), V(20, [3, 4], [0, 1])
    for _ in range(3):  # every view read again from the cache, after the writes through the others
        m.op(aten.add.out, whole, V(20, [3, 4]), out=V(21, [3, 4]))
        m.op(aten.mul.out, transposed, 2.0, out=V(22, [4, 3]))
        m.op(aten.sum.IntList_out, rows, [1], out=V(23, [2]))
        m.op(aten.mul_.Scalar, column, -1.0)  # in place on a cached view, seen through all the others
        m.op(aten.add_.Tensor, rows, V(20, [2, 4], [0, 1]))
        m.op(aten.add.out, broadcast, 0.5, out=V(24, [3, 4]))
        m.check()
        m.free(21), m.free(22), m.free(23), m.free(24)


def test_ops_over_lists_of_cached_views_match_the_cpu():
    m = Mirror()
    m.new(30, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    parts = [V(30, [2], offset=0), V(30, [2], offset=2), V(30, [2], offset=4)]
    for _ in range(3):
        m.op(aten._foreach_mul_.Scalar, parts, 1.5)
        m.op(aten._foreach_add_.List, parts, [V(30, [2], offset=4)] * 3)
    m.check()


@pytest.mark.parametrize("change", ["transpose_", "unsqueeze_", "as_strided_", "set_"])
def test_an_op_that_changes_its_arguments_layout_leaves_no_stale_view(change):
    m = Mirror()
    m.new(40, [float(i) for i in range(6)])
    m.new(41, [float(-i) for i in range(6)])
    a = V(40, [2, 3])
    m.op(aten.add.out, a, 1.0, out=V(42, [2, 3]))  # caches a's view
    if change == "transpose_":
        m.op(aten.transpose_.default, a, 0, 1)
    elif change == "unsqueeze_":
        m.op(aten.unsqueeze_.default, a, 0)
    elif change == "as_strided_":
        m.op(aten.as_strided_.default, a, [3], [2], 1)
    else:
        m.op(aten.set_.source_Tensor, a, V(41, [2, 3]))
    m.op(aten.add.out, a, 1.0, out=V(43, [2, 3]))  # the descriptor still names storage 40, as laid out
    m.op(aten.mul_.Scalar, a, 2.0)
    m.check()
    entry = m.ex.table.entries[40]
    for (code, size, stride, offset), v in entry.views.items():   # each cached view still as its key says
        assert (CODE_BY_DTYPE[v.dtype], v.shape, v.stride(), v.storage_offset()) == (code, size, stride, offset)
        assert v.untyped_storage().data_ptr() == entry.ptr


def test_an_output_bound_from_a_result_is_the_next_ops_view_and_takes_in_place_updates():
    m = Mirror()
    m.new(50, [1.0, 2.0, 3.0, 4.0])
    m.ex.handle([Msg.DEFINE, 99, "add.Tensor", str(aten.add.Tensor._schema)], [], False)
    m.ex.handle([Msg.OP, [], 99, [{"t": m.desc(V(50, [2, 2]))}, {"t": m.desc(V(50, [2, 2]))}], {},
                 [[51, 16, CODE_BY_DTYPE[torch.float32], [2, 2], [2, 1], 0, 0]]], [], False)
    m.cpu[51] = (m.tensor(V(50, [4])) * 2).view(torch.uint8).clone()
    m.op(aten.add_.Scalar, V(51, [2, 2]), 1.0)
    m.op(aten.mul.out, V(51, [4]), V(51, [4]), out=V(52, [4]))
    m.check()


def test_a_storage_keeps_a_bounded_number_of_views_and_every_one_reads_right():
    m = Mirror()
    m.new(60, [float(i) for i in range(64)])
    for i in range(60):
        m.op(aten.add.out, V(60, [4], offset=i), 0.0, out=V(100 + i, [4]))
    assert len(m.ex.table.entries[60].views) <= MAX_VIEWS
    m.check()


def test_a_failed_call_drops_the_views_of_what_it_would_write():
    m = Mirror()
    m.new(70, [1.0, 2.0])
    m.new(71, [1.0, 2.0, 3.0])
    m.op(aten.add.out, V(70, [2]), 1.0, out=V(72, [2]))
    assert m.ex.table.entries[70].views
    with pytest.raises(OpFailed, match="must match") as info:
        m.op(aten.add_.Tensor, V(70, [2]), V(71, [3]), call=True)
    assert info.value.op == "aten.add_.Tensor" and not m.ex.table.entries[70].views


def test_a_resized_out_tensor_fails_and_its_id_names_the_failure():
    m = Mirror()
    m.new(80, [1.0, 2.0, 3.0, 4.0])
    m.op(aten.add.out, V(80, [4]), 1.0, out=V(81, [4]))
    with pytest.raises(OpFailed, match="resize it first"):
        m.op(aten.add.out, V(80, [4]), 1.0, out=V(81, [2]))
    with pytest.raises(OpFailed, match="resize it first"):  # reading it names the first failure
        m.ex.handle([Msg.DOWNLOAD, [], m.desc(V(81, [4]))], [], True)


def _op(m: Mirror, index: int, args: list, outs=None):
    m.ex.handle([Msg.OP, [], index, args, {}, outs], [], False)


@pytest.mark.parametrize("bad, message", [
    ([90, 16, 99, [4], [1], 0, 0], "unknown dtype code 99"),
    ([90, 16, -1, [4], [1], 0, 0], "unknown dtype code -1"),
    ([90, 16, 14, [4], [1], 0, 0], "dtype code 14 is not a dtype"),   # qint32: a view of raw bytes crashed torch
    ([90, 16, 13, [4], [1], 0, 0], "dtype code 13 is not a dtype"),   # quint8
    ([90, 1 << 62, 6, [4], [1], 0, 0], None),                     # an allocation no device has
    ([90, 16, 6, [1 << 40], [1], 0, 0], "out of bounds"),         # never allocated: the storage is 16 bytes
    ([90, 16, 6, [2], [1 << 40], 0, 0], "out of bounds"),
    ([90, 16, 6, [8], [1], 0, 0], "out of bounds"),                # reaches past its storage
    ([90, 16, 6, [4], [1], 0], "IndexError"),                      # a descriptor one field short
    (["90", 16, 6, [4], [1], 0, 0], None),
    ([90, 16, 6, 4, [1], 0, 0], None),
    ([90, 16, 6, [4], [1], 0, 7], "does not exist"),               # a device the server lacks
])
def test_a_bad_descriptor_is_refused_clearly_and_the_session_goes_on(bad, message):
    m = Mirror()
    m.new(1, [1.0, 2.0, 3.0, 4.0])
    m.op(aten.neg.out, V(1, [4]), out=V(2, [4]))
    with pytest.raises(OpFailed, match=message) as info:
        _op(m, m.index[aten.neg.out], [{"t": bad}], None)
    assert info.value.op == "aten.neg.out"
    with pytest.raises(OpFailed, match="before it was defined"):
        _op(m, 12345, [])
    m.op(aten.neg.out, V(2, [4]), out=V(3, [4]))
    m.check()


def test_ops_run_the_same_inside_the_session_loops_inference_mode_and_outside_it():
    m = Mirror()
    m.new(1, [1.0, 2.0, 3.0, 4.0])
    with m.ex.serving():
        assert torch.is_inference_mode_enabled()
        m.op(aten.add.out, V(1, [4]), 1.0, out=V(2, [4]))
    assert not torch.is_inference_mode_enabled()
    m.op(aten.add.out, V(2, [4]), 1.0, out=V(3, [4]))
    m.check()


def test_one_result_returned_twice_is_bound_to_two_storages_of_their_own():
    # the CPU's eval-mode batch norm returns no statistics; the executor fills both with one zeros tensor
    m = Mirror()
    m.new(1, [float(i) for i in range(8)])  # input [2, 2, 2]
    m.new(2, [1.0, 1.0])  # weight, bias, running mean, running var
    m.new(3, [0.0, 0.0])
    f32 = CODE_BY_DTYPE[torch.float32]
    op = aten._native_batch_norm_legit_no_training.default
    m.ex.handle([Msg.DEFINE, 1, "_native_batch_norm_legit_no_training.default", str(op._schema)], [], False)
    args = [{"t": m.desc(V(1, [2, 2, 2]))}, {"t": m.desc(V(2, [2]))}, {"t": m.desc(V(3, [2]))},
            {"t": m.desc(V(3, [2]))}, {"t": m.desc(V(2, [2]))}, 0.1, 1e-5]
    outs = [[4, 32, f32, [2, 2, 2], [4, 2, 1], 0, 0], [5, 8, f32, [2], [1], 0, 0], [6, 8, f32, [2], [1], 0, 0]]
    m.ex.handle([Msg.OP, [], 1, args, {}, outs], [], False)
    entries = m.ex.table.entries
    assert entries[5].ptr != entries[6].ptr
    m.cpu[5], m.cpu[6] = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    m.op(aten.add_.Scalar, V(5, [2]), 1.0)  # the other statistic stays as it was
    m.check()


def test_a_random_mix_of_views_writes_frees_and_growth_matches_the_cpu():
    rng = __import__("random").Random(7)
    m = Mirror()
    live = []
    next_id = 1

    def fresh_storage():
        nonlocal next_id
        m.new(next_id, [rng.uniform(-4, 4) for _ in range(32)])
        live.append(next_id)
        next_id += 1

    def some_view(sid):
        size = [rng.randint(1, 3), rng.randint(1, 3)]
        stride = rng.choice([[size[1], 1], [1, size[0]], [0, 1], [2 * size[1], 2]])
        span = 1 + sum((n - 1) * s for n, s in zip(size, stride))
        return V(sid, size, stride, rng.randint(0, m.cpu[sid].numel() // 4 - span))

    for _ in range(4):
        fresh_storage()
    some_views = [some_view(sid) for sid in live for _ in range(2)]  # read again and again below
    for step in range(300):
        kind = rng.random()
        a, b = rng.sample(live, 2)
        va, vb = some_view(a), some_view(b)
        old = rng.choice(some_views)
        if rng.random() < 0.9 and old.sid in live and old.sid != b:  # a descriptor seen before
            a, va = old.sid, old
        if kind < 0.15:  # a fresh output from two views
            m.op(aten.add.out, va, V(b, va.size, [0, 0], vb.offset), out=V(next_id, va.size))
            next_id += 1  # kept, never read: checked at the end
        elif kind < 0.3:  # an output into a third storage's view
            c = next(sid for sid in live if sid not in (a, b))
            m.op(aten.add.out, va, V(b, va.size, [0, 0], vb.offset), out=V(c, va.size, offset=rng.randint(0, 6)))
        elif kind < 0.5:  # in place through a view whose stride is not 0
            if va.stride[0] and va.stride[1]:
                m.op(aten.mul_.Scalar, va, rng.choice([-1.0, 0.5, 2.0]))
        elif kind < 0.65:  # a copy between storages
            if vb.stride[0] and vb.stride[1]:
                m.op(aten.copy_.default, vb, V(a, vb.size, [0, 1], va.offset))
        elif kind < 0.72:  # a layout change on the server's view only
            m.op(aten.transpose_.default, va, 0, 1)
        elif kind < 0.8:  # freed, and the id used again at once (views of it were likely cached)
            n = m.cpu[a].numel() // 4
            m.free(a)
            m.new(a, [rng.uniform(-4, 4) for _ in range(n)])
        elif kind < 0.86:
            if m.cpu[a].numel() < 256:
                m.grow(next_id, a, m.cpu[a].numel() * 2)
                live[live.index(a)] = next_id
                some_views += [some_view(next_id) for _ in range(2)]
                m.op(aten.fill_.Scalar, V(next_id, [m.cpu[next_id].numel() // 8], offset=m.cpu[next_id].numel() // 8),
                     1.0)
                next_id += 1
        else:
            m.op(aten.sum.IntList_out, va, [1], out=V(next_id, [va.size[0]]))
            next_id += 1
        if step % 50 == 49:
            m.check()
    m.check()


def test_small_downloads_are_answered_in_cpp_and_the_unusual_ones_in_python_alike(op_path):
    m = Mirror()
    m.new(1, list(range(12)))
    m.op(aten.mul.out, V(1, [12]), 3.0, out=V(2, [12]))
    strided = V(2, [3, 2], [4, 2], 1)                      # a view with gaps: its bytes, in order
    want = m.tensor(strided).contiguous().view(torch.uint8).numpy().tobytes()
    _, bufs = m.ex.handle([Msg.DOWNLOAD, m._drain(), m.desc(strided)], [], True)
    assert bytes(bufs[0]) == want
    m.free(1)                                              # a free in the download's own message: applied first
    m.check()
    if op_path:
        assert m.ex.fast.downloads >= 2
    # what C++ declines, Python refuses by name (the poisoned: test_a_resized_out_tensor_fails_and_its_id_names...)
    with pytest.raises(Exception, match="out of bounds"):
        m.ex.handle([Msg.DOWNLOAD, [], [2, 48, 6, [16], [1], 0, 0]], [], True)   # past its storage
    with pytest.raises(Exception, match="unknown dtype code 99"):
        m.ex.handle([Msg.DOWNLOAD, [], [2, 48, 99, [4], [1], 0, 0]], [], True)
