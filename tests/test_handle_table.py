"""The ops route's handle table, both implementations (the C++ class of ``handle_table.h`` and ``handles.py``'s
Python one) against the same cases: ids, views and their cache, byte counts, frees, poison, events, evictions.

The C++ one is skipped (with the reason) where the C++ op path cannot be built here.
"""
from __future__ import annotations

import random

import pytest
import torch

from rgpu.protocol.ops import Event
from rgpu.server.ops import fast_op, handles
from rgpu.server.ops.codec import CODE_BY_DTYPE
from rgpu.server.ops.handles import MAX_VIEWS, Poisoned

F32 = CODE_BY_DTYPE[torch.float32]
CPU = torch.device("cpu")


def _native():
    module = fast_op.load()
    if module is None:
        pytest.skip(f"no C++ op path here: {fast_op.why_not()}")
    return module


@pytest.fixture(params=["python", "cpp"])
def make(request):
    """Makes a table of the parameter's implementation over ``devices`` CPU devices."""
    native = _native() if request.param == "cpp" else None

    def table(devices: int = 1, device: torch.device = CPU):
        t = handles.table([device] * devices, None, native)
        assert isinstance(t, handles.HandleTable) == (native is None)
        return t
    return table


def desc(sid, n=4, size=None, stride=None, offset=0, dev=0, nbytes=None):
    size = [n] if size is None else size
    stride = [1] if stride is None else stride
    return [sid, 4 * n if nbytes is None else nbytes, F32, size, stride, offset, dev]


def test_an_id_first_named_is_allocated_and_counted_and_a_free_uncounts_it(make):
    t = make(2)
    ptrs = []
    v = t.view(desc(1, dev=1), ptrs)
    assert v.shape == (4,) and v.dtype == torch.float32 and ptrs == [v.data_ptr()]
    assert t.allocated == [0, 16] and t.peak == [0, 16] and sorted(t.entries) == [1]
    t.tensor(desc(2, nbytes=64, size=[2], offset=3))   # bytes first, then viewed
    assert t.allocated == [64, 16] and t.address(2) is not None
    t.free(1)
    t.free(12345)   # never named: nothing
    assert t.allocated == [64, 0] and t.peak == [64, 16] and 1 not in t.entries and t.address(1) is None


def test_a_view_is_cached_per_layout_and_a_tensor_is_a_view_of_its_own(make):
    t = make()
    a = t.view(desc(1, n=8), [])
    assert t.view(desc(1, n=8), []) is a
    assert t.tensor(desc(1, n=8)) is not a and t.tensor(desc(1, n=8)).data_ptr() == a.data_ptr()
    b = t.view(desc(1, n=8, size=[2, 2], stride=[1, 2], offset=1), [])
    assert b.stride() == (1, 2) and b.storage_offset() == 1 and b.untyped_storage().data_ptr() == a.data_ptr()
    for i in range(3 * MAX_VIEWS):   # x[i] for every i: the cache starts again past its bound
        t.view(desc(1, n=8, size=[1], offset=i % 8), [])
    assert len(t.entries[1].views) <= MAX_VIEWS


def test_a_storage_of_no_bytes_is_kept_nowhere(make):
    t = make()
    ptrs = []
    v = t.view([0, 0, F32, [0, 3], [3, 1], 0, 0], ptrs)
    assert v.shape == (0, 3) and ptrs == [] and 0 not in t.entries and t.allocated == [0]


@pytest.mark.parametrize("bad, error, message", [
    (desc(1, size=[8]), RuntimeError, "out of bounds"),                 # past its 16 bytes
    (desc(1, stride=[-1], offset=3), RuntimeError, "Negative strides"),
    (desc(1, offset=-1), RuntimeError, "invalid storage offset -1"),
    ([1, 16, 99, [4], [1], 0, 0], ValueError, "unknown dtype code 99"),
    ([1, 16, 14, [4], [1], 0, 0], ValueError, "dtype code 14 is not a dtype rgpu's tensors can have"),   # qint32
    ([1, 16, 12, [4], [1], 0, 0], ValueError, r"dtype code 12 is not a dtype .* \(quantized"),            # qint8
    ([1, 16, F32, [4], [1], 0], ValueError, "expected 7"),
    (desc(5, dev=3), IndexError, r"rgpu:3 does not exist \(the server has 2 devices\)"),
])
def test_a_bad_descriptor_is_refused_as_the_python_table_refuses_it(make, bad, error, message):
    t = make(2)
    t.view(desc(1), [])
    with pytest.raises(error, match=message):
        t.view(bad, [])
    with pytest.raises(error, match=message):
        t.tensor(bad)


def test_a_poisoned_id_raises_its_first_failure_until_it_is_freed_or_bound(make):
    t = make()
    t.view(desc(1), [])
    cause = Poisoned("aten.add.out", "shapes must match")
    t.poison(1, 0, cause)
    assert t.allocated == [0] and t.address(1) is None and t.entries[1].poison is cause
    for read in (lambda: t.view(desc(1), []), lambda: t.tensor(desc(1))):
        with pytest.raises(Poisoned, match="shapes must match") as info:
            read()
        assert info.value is cause
    t.bind(1, torch.ones(4).untyped_storage(), 0)
    assert t.tensor(desc(1)).tolist() == [1.0] * 4


def test_keep_drops_a_cached_view_an_op_changed_and_forget_drops_them_all(make):
    t = make()
    v = t.view(desc(1, n=6, size=[2, 3], stride=[3, 1]), [])
    assert t.keep(desc(1, n=6, size=[2, 3], stride=[3, 1]), v)
    v.transpose_(0, 1)
    assert not t.keep(desc(1, n=6, size=[2, 3], stride=[3, 1]), v)
    w = t.view(desc(1, n=6, size=[2, 3], stride=[3, 1]), [])
    assert w is not v and w.stride() == (3, 1)
    assert not t.keep(desc(1, n=6, size=[2, 3], stride=[3, 1]), torch.zeros(2, 3))   # another storage
    assert t.entries[1].views
    t.forget(1)
    t.forget("not an id")
    assert not t.entries[1].views


def test_a_bound_output_is_its_ids_next_view_and_replaces_what_the_id_named(make):
    t = make()
    t.view(desc(1), [])
    out = torch.arange(8.0)
    t.bind(1, out.untyped_storage(), 0, (desc(1, n=8), out))
    assert t.view(desc(1, n=8), []) is out and t.allocated == [32] and t.address(1) == out.data_ptr()


def test_an_evicted_id_moves_to_a_copy_of_its_bytes(make):
    t = make()
    v = t.view(desc(1), [])
    v.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    ptr = v.data_ptr()
    assert not t.evict(1, ptr + 1) and not t.evict(2, ptr)
    assert t.evict(1, ptr)
    w = t.view(desc(1), [])
    assert w.data_ptr() != ptr and w.tolist() == [1.0, 2.0, 3.0, 4.0] and t.allocated == [16]


def test_events_free_and_grow_storages_and_a_failure_grows_into_the_new_id(make):
    t = make()
    t.view(desc(1), []).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    t.view(desc(2), [])
    t.apply_events([Event.FREE, 2, Event.COPY, 3, 32, 0, 1, 16, Event.FREE, 1])
    assert sorted(t.entries) == [3] and t.allocated == [32]
    assert t.tensor(desc(3, n=8))[:4].tolist() == [1.0, 2.0, 3.0, 4.0]
    t.poison(3, 0, Poisoned("op", "it failed"))
    t.apply_events([Event.COPY, 4, 64, 0, 3, 32])
    with pytest.raises(Poisoned, match="it failed"):
        t.tensor(desc(4, n=16))
    t.apply_events([])
    with pytest.raises(ValueError, match="unknown allocator event 7"):
        t.apply_events([7, 1])


def test_a_list_of_wire_tensors_is_viewed_in_one_call_or_not_at_all(make):
    t = make()
    ptrs = []
    got = t.view_list([{"t": desc(1)}, {"t": desc(2)}], ptrs)
    assert [g.shape for g in got] == [(4,), (4,)] and len(ptrs) == 2
    assert t.view_list([{"t": desc(1)}, 3.0], []) is None


def test_close_forgets_every_id_and_count(make):
    t = make()
    t.view(desc(1), [])
    t.close()
    assert len(t.entries) == 0 and t.allocated == [0] and t.peak == [16]


@pytest.mark.gpu
def test_on_a_gpu_fresh_ids_growth_and_evictions_keep_their_bytes(make):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (the device tool's host)")
    cuda = torch.device("cuda", 0)
    t = make(1, cuda)
    v = t.view(desc(1), [])
    assert v.device == cuda and t.address(1) == v.data_ptr()
    v.copy_(torch.arange(4.0, device=cuda))
    t.apply_events([Event.COPY, 2, 32, 0, 1, 16, Event.FREE, 1])
    assert t.tensor(desc(2, n=8))[:4].tolist() == [0.0, 1.0, 2.0, 3.0] and t.allocated == [32]
    ptr = t.address(2)
    assert t.evict(2, ptr)
    w = t.view(desc(2, n=8), [])
    assert w.device == cuda and w.data_ptr() != ptr and w[:4].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_random_mix_leaves_both_tables_with_the_same_ids_bytes_and_counts():
    native = _native()
    rng = random.Random(11)
    tables = [handles.table([CPU, CPU], None, None), handles.table([CPU, CPU], None, native)]
    for step in range(400):
        sid, dev, n = rng.randrange(1, 12), rng.randrange(2), rng.choice([2, 4, 8])
        action = rng.choice(["view", "view", "write", "free", "grow", "poison", "bind"])
        got = []
        for t in tables:
            try:
                if action == "view":
                    v = t.view(desc(sid, n=n, size=[n // 2], offset=n // 2, dev=dev), [])
                    got.append((v.shape, v.stride(), v.storage_offset()))   # fresh bytes are uninitialised
                elif action == "write":
                    t.view(desc(sid, n=n, dev=dev), []).fill_(float(step))
                    got.append(t.tensor(desc(sid, n=n, dev=dev)).tolist())
                elif action == "free":
                    t.apply_events([Event.FREE, sid])
                elif action == "grow":
                    t.apply_events([Event.COPY, sid + 20, 4 * n, dev, sid, 8])
                elif action == "poison":
                    t.poison(sid, dev, Poisoned("op", f"failed at {step}"))
                else:
                    t.bind(sid, torch.full((n,), -1.0).untyped_storage(), dev)
            except (Poisoned, RuntimeError) as exc:
                got.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        assert len(got) in (0, 2) and (not got or str(got[0]) == str(got[1])), (step, action, got)
        py, cpp = tables
        assert sorted(py.entries) == sorted(cpp.entries) and py.allocated == cpp.allocated and py.peak == cpp.peak
        assert [py.address(i) is None for i in range(40)] == [cpp.address(i) is None for i in range(40)]
