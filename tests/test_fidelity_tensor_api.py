"""The rest of the tensor API on rgpu behaves as on CUDA: metadata-changing in-place ops, out=, complex views,
saving and loading, copies, pinned memory, numpy() and torch.compile's default backend."""
from __future__ import annotations

import io

import pytest
import torch
from device_helpers import rgpu_device  # noqa: F401


def _same(cpu: torch.Tensor, dev: torch.Tensor) -> bool:
    return (dev.device.type == "rgpu" and cpu.shape == dev.shape and cpu.stride() == dev.stride()
            and cpu.storage_offset() == dev.storage_offset() and torch.equal(cpu, dev.cpu()))


METADATA_OPS = {
    "t_": lambda t: t.t_(),
    "transpose_": lambda t: t.transpose_(0, 1),
    "squeeze_": lambda t: t.unsqueeze_(0).squeeze_(0).squeeze_(),
    "unsqueeze_": lambda t: t.unsqueeze_(1),
    "as_strided_": lambda t: t.as_strided_((2, 2), (1, 4), 1),
    "resize_ (grow)": lambda t: t.resize_(4, 4)[:3],  # the new row is uninitialised: compare the old ones
    "resize_ (shrink)": lambda t: t.resize_(2, 3),
    "resize_as_": lambda t: t.resize_as_(torch.empty(2, 2, device=t.device)),
    "set_ (storage)": lambda t: t.set_(t.untyped_storage(), 2, (2, 2), (4, 1)),
    "set_ (tensor)": lambda t: t.set_(t[1:].clone()),
    "set_ (empty)": lambda t: t.set_(),
    "transpose_ then add_": lambda t: t.transpose_(0, 1).add_(torch.arange(3.0, device=t.device)),
}


@pytest.mark.parametrize("name", list(METADATA_OPS))
def test_in_place_ops_that_change_metadata_match_the_cpu(rgpu_device, name):
    fn = METADATA_OPS[name]
    x = torch.arange(12.0).reshape(3, 4)
    cpu, dev = x.clone(), x.clone().to("rgpu")
    r_cpu, r_dev = fn(cpu), fn(dev)
    assert _same(cpu[:3] if "grow" in name else cpu, dev[:3] if "grow" in name else dev)
    assert _same(r_cpu, r_dev)


def test_out_tensors_of_any_size_are_resized_as_on_cuda(rgpu_device):
    x = torch.arange(6.0).reshape(2, 3)
    d = x.to("rgpu")
    empty, small = torch.empty(0, device="rgpu"), torch.empty(2, device="rgpu")
    torch.mm(d, d.t(), out=empty)
    with pytest.warns(UserWarning, match="was resized"):
        torch.sum(d, 0, out=small)
    values, indices = torch.empty(0, device="rgpu"), torch.empty(0, dtype=torch.long, device="rgpu")
    torch.max(d, 1, out=(values, indices))
    assert torch.equal(empty.cpu(), x @ x.t()) and torch.equal(small.cpu(), x.sum(0))
    assert torch.equal(values.cpu(), x.max(1).values) and torch.equal(indices.cpu(), x.max(1).indices)
    a, b = torch.randn(3, 3), torch.randn(3, 2)
    sol = torch.empty(0, device="rgpu")  # an out= op with no meta kernel: the server sizes it
    torch.linalg.lstsq(a.to("rgpu"), b.to("rgpu"), out=(sol, torch.empty(0, device="rgpu"),
                                                        torch.empty(0, dtype=torch.long, device="rgpu"),
                                                        torch.empty(0, device="rgpu")))
    assert torch.allclose(sol.cpu(), torch.linalg.lstsq(a, b).solution, atol=1e-5)


def test_complex_tensors_keep_their_conjugate_and_negative_bits(rgpu_device):
    torch.manual_seed(0)
    a, b = torch.randn(3, 3, dtype=torch.complex64), torch.randn(3, 3, dtype=torch.complex64)
    da, db = a.to("rgpu"), b.to("rgpu")
    assert da.conj().is_conj() and da.conj().imag.is_neg()
    pairs = [
        (da.conj(), a.conj()), (da.mH @ db, a.mH @ b), (da.conj().imag, a.conj().imag),
        (torch.vdot(da[0], db[0]), torch.vdot(a[0], b[0])), (da.conj().unfold(1, 2, 1), a.conj().unfold(1, 2, 1)),
        (torch.vdot(da[0], db[0].conj()), torch.vdot(a[0], b[0].conj())),  # the kernel returns a conj view
        (torch.linalg.lu_solve(*torch.linalg.lu_factor(da), db, left=False),  # its kernel flips the out's bit
         torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False)),
        (torch.addmm(da, da.conj(), db.mT), torch.addmm(a, a.conj(), b.mT)), (a.conj().to("rgpu"), a.conj()),
        (da.conj().imag * 2, a.conj().imag * 2), (torch.view_as_real(da.conj().resolve_conj()), torch.view_as_real(a.conj().resolve_conj())),
    ]
    for dev, cpu in pairs:
        assert torch.allclose(dev.cpu(), cpu, atol=1e-5)
    into = da.clone()
    into.conj().copy_(db)  # writing through a conjugate view
    view = da.clone().conj()
    view.add_(1)  # an in-place op on a conjugate view
    host = torch.empty(3, 3, dtype=torch.complex64).conj()
    host.copy_(da)  # downloading into a conjugate view
    assert torch.allclose(into.cpu(), b.conj()) and torch.allclose(view.cpu(), a.conj() + 1)
    assert torch.allclose(host, a)


def test_torch_save_and_load_move_tensors_both_ways(rgpu_device):
    x = torch.arange(6.0).reshape(2, 3)
    buf = io.BytesIO()
    torch.save({"d": x.to("rgpu"), "c": x}, buf)
    for where, device in ((None, "rgpu"), ("cpu", "cpu"), ("rgpu", "rgpu"), ({"rgpu:0": "cpu"}, "cpu")):
        buf.seek(0)
        loaded = torch.load(buf, map_location=where)
        assert loaded["d"].device.type == device and torch.equal(loaded["d"].cpu(), x)
    buf.seek(0)
    assert torch.load(buf, map_location="rgpu")["c"].device == torch.device("rgpu", 0)
    model = torch.nn.Linear(3, 2).to("rgpu")
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    back = torch.nn.Linear(3, 2)
    back.load_state_dict(torch.load(buf, map_location="cpu"))
    assert torch.equal(back.weight, model.weight.cpu())


def test_copies_between_the_cpu_and_the_device_convert_and_keep_strides(rgpu_device):
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    d = torch.empty(4, 3, dtype=torch.float32, device="rgpu")
    d.copy_(x.t())  # a non-contiguous source, converted
    e = torch.zeros(3, 4, dtype=torch.int32, device="rgpu")
    e.t().copy_(d)  # device to device, into a transposed view, converted
    host = torch.empty(4, 3, dtype=torch.float64).t()
    host.copy_(e)  # device to a non-contiguous host view
    assert torch.equal(d.cpu(), x.t().float()) and torch.equal(e.cpu(), x.int()) and torch.equal(host, x)
    assert torch.equal(x.to("rgpu", torch.bfloat16).cpu(), x.to(torch.bfloat16))


def test_pinned_cpu_tensors_report_pinned_and_upload_as_on_cuda(rgpu_device):
    x = torch.arange(8.0).pin_memory()
    y = torch.empty(8, pin_memory=True)
    assert x.is_pinned() and y.is_pinned() and not torch.arange(3.0).is_pinned()
    assert torch.equal(x.to("rgpu", non_blocking=True).cpu(), x)
    loader = torch.utils.data.DataLoader(torch.arange(6.0), batch_size=3, pin_memory=True)
    assert all(batch.is_pinned() for batch in loader)


def test_numpy_of_a_device_tensor_fails_as_on_cuda(rgpu_device):
    with pytest.raises(TypeError, match=r"can't convert rgpu:0 device type tensor to numpy. Use Tensor.cpu\(\)"):
        torch.ones(2, device="rgpu").numpy()


def test_torch_compile_with_the_default_backend_points_to_the_rgpu_backend(rgpu_device):
    torch._dynamo.reset()
    fn = torch.compile(lambda t: t * 2 + 1)
    with pytest.raises(Exception, match='backend="rgpu"'):
        fn(torch.ones(3, device="rgpu"))
    torch._dynamo.reset()


def test_batch_norm_in_eval_mode_and_cpu_index_tensors_work_as_on_cuda(rgpu_device):
    bn = torch.nn.BatchNorm1d(3).eval()
    bn.running_mean.fill_(0.5)
    x = torch.randn(4, 3)
    assert torch.allclose(bn.to("rgpu")(x.to("rgpu")).cpu(), bn.cpu()(x), atol=1e-6)
    d, idx = x.to("rgpu"), torch.tensor([2, 0])
    assert torch.equal(d[idx].cpu(), x[idx]) and torch.equal(d[idx, 1:].cpu(), x[idx, 1:])
    d[idx] = torch.zeros(2, 3, device="rgpu")
    x[idx] = 0
    assert torch.equal(d.cpu(), x)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_values_and_gradients_match_the_cpu(rgpu_device, mode, include_last_offset):
    torch.manual_seed(0)
    weight, indices = torch.randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 4, 8] if include_last_offset else [0, 4])
    results = []
    for dev in ("cpu", "rgpu"):
        w = weight.clone().to(dev).requires_grad_()
        out = torch.nn.functional.embedding_bag(indices.to(dev), w, offsets.to(dev), mode=mode,
                                                include_last_offset=include_last_offset)
        (out * torch.arange(6.0).reshape(2, 3).to(dev)).sum().backward()
        results.append((out.detach().cpu(), w.grad.cpu()))
    assert torch.allclose(results[0][0], results[1][0]) and torch.allclose(results[0][1], results[1][1])
