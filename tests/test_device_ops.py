"""Ops on the rgpu device give the CPU's values: views alias exactly, in-place ops, data, copies, errors."""
from __future__ import annotations

import copy

import pytest
import torch
from device_helpers import rgpu_device  # noqa: F401

import rgpu
from rgpu.protocol.ops import Msg


def test_views_share_storage_with_their_base_and_see_in_place_changes(rgpu_device):
    a = torch.arange(12.0).reshape(3, 4).to("rgpu")
    row, col, t = a[1], a[:, 2], a.t()
    assert row.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    row.add_(100)
    col.mul_(-1)
    expected = torch.arange(12.0).reshape(3, 4)
    expected[1] += 100
    expected[:, 2] *= -1
    assert torch.equal(a.cpu(), expected) and torch.equal(t.cpu(), expected.t())
    assert torch.equal(a.view(torch.int32).cpu(), expected.view(torch.int32))
    assert torch.equal(a.unfold(1, 2, 1).cpu(), expected.unfold(1, 2, 1))


def test_in_place_and_out_ops_match_the_cpu(rgpu_device):
    x = torch.randn(4, 5)
    d = x.to("rgpu")
    d.add_(1.5).mul_(2).clamp_(max=3.0)
    out = torch.empty(0, device="rgpu")
    torch.matmul(d, d.t(), out=out)  # an empty out= tensor is sized on the client
    ref = x.add(1.5).mul(2).clamp(max=3.0)
    assert torch.allclose(d.cpu(), ref) and torch.allclose(out.cpu(), ref @ ref.t(), atol=1e-6)
    r = torch.arange(2, 20, 3, device="rgpu")
    assert torch.equal(r.cpu(), torch.arange(2, 20, 3))


def test_resize_grows_the_storage_and_keeps_its_bytes(rgpu_device):
    t = torch.arange(4.0).to("rgpu")
    t.resize_(10)
    assert t.shape == (10,) and torch.equal(t[:4].cpu(), torch.arange(4.0))
    t.untyped_storage().resize_(100)
    assert torch.equal(t[:4].cpu(), torch.arange(4.0))


def test_data_reads_item_tolist_bool_and_printing_work(rgpu_device):
    t = torch.tensor([[1.5, -2.0], [0.0, 4.0]]).to("rgpu")
    assert t.sum().item() == 3.5
    assert t.tolist() == [[1.5, -2.0], [0.0, 4.0]]
    assert bool(t.abs().max() > 3)
    assert "device='rgpu:0'" in repr(t) and "1.5000" in repr(t)


def test_data_dependent_shapes_are_sized_by_the_server(rgpu_device):
    x = torch.tensor([3.0, -1.0, 0.0, 3.0, 2.0])
    d = x.to("rgpu")
    assert torch.equal(d.nonzero().cpu(), x.nonzero())
    assert torch.equal(d[d > 0].cpu(), x[x > 0])
    assert torch.equal(torch.unique(d).cpu(), torch.unique(x))
    assert torch.equal((d[d > 0] * 2).cpu(), x[x > 0] * 2)  # the server-sized tensor streams on


def test_uploads_copy_at_the_call_so_later_changes_to_the_source_never_arrive(rgpu_device):
    small, big = torch.zeros(8), torch.zeros(1 << 20)
    d_small, d_big = small.to("rgpu"), big.to("rgpu")
    dst = torch.empty(8, device="rgpu")
    dst.copy_(small)
    small.fill_(7.0)
    big.fill_(7.0)
    assert d_small.sum().item() == 0 and d_big.sum().item() == 0 and dst.sum().item() == 0


def test_copies_convert_dtype_and_broadcast_both_ways(rgpu_device):
    d = torch.empty(2, 3, device="rgpu", dtype=torch.float64)
    d.copy_(torch.tensor([1, 2, 3], dtype=torch.int32))
    assert torch.equal(d.cpu(), torch.tensor([[1.0, 2, 3], [1, 2, 3]], dtype=torch.float64))
    host = torch.zeros(3, 2, dtype=torch.float32)
    host.copy_(d.t())
    assert torch.equal(host, torch.tensor([[1.0, 2, 3], [1, 2, 3]]).t())
    assert torch.equal(d.to(torch.bfloat16).cpu(), d.cpu().to(torch.bfloat16))


def test_shape_and_dtype_errors_raise_on_the_client_without_a_message(rgpu_device):
    a, b = torch.ones(2, 3, device="rgpu"), torch.ones(4, device="rgpu")
    ints = torch.ones(2, dtype=torch.long, device="rgpu")
    before = rgpu.stats()["messages"]
    with pytest.raises(RuntimeError, match="size of tensor"):
        a + b
    with pytest.raises(RuntimeError, match="can't be cast"):
        ints.add_(0.5)
    assert rgpu.stats()["messages"] == before


def test_a_failing_op_poisons_what_depends_on_it_and_is_raised_once(rgpu_device):
    # Why this failure: 512 TiB cannot be allocated on any server (CPU or GPU, a clean error,
    # unlike a device-side assert), yet on the client an empty tensor is only a minted id.
    huge = torch.empty(1 << 47, dtype=torch.float32, device="rgpu")
    healthy = torch.ones(4, device="rgpu")
    huge.fill_(1.0)  # fails on the server
    later = huge[:4] * 2
    with pytest.raises(rgpu.RemoteError) as info:
        healthy.sum().item()
    assert "fill_" in str(info.value)
    assert healthy.sum().item() == 4.0  # raised once: the session goes on
    with pytest.raises(rgpu.RemoteError, match="fill_"):
        later.cpu()  # reading what depends on it names the op that failed


def test_an_op_whose_schema_differs_is_refused_by_name(rgpu_device):
    s = rgpu_device
    s.post([Msg.DEFINE, 10_000, "add.Tensor", "aten::add.Tensor(Tensor self) -> Tensor"])
    a = torch.ones(1, device="rgpu")
    desc = {"t": s.C.describe(a)}
    s.post([Msg.OP, [], 10_000, [desc, desc], {}, None])
    with pytest.raises(rgpu.RemoteError, match="schema differs"):
        torch.rgpu.synchronize()


def test_ops_that_touch_files_are_refused(rgpu_device):
    s = rgpu_device
    s.post([Msg.DEFINE, 10_001, "from_file.default", str(torch.ops.aten.from_file.default._schema)])
    s.post([Msg.OP, [], 10_001, ["/etc/passwd"], {}, None])
    with pytest.raises(rgpu.RemoteError, match="reads a file"):
        torch.rgpu.synchronize()


def test_convolutions_and_their_gradients_match_the_cpu(rgpu_device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.ConvTranspose2d(8, 4, 2, stride=2, groups=2), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(4, 2))
    x = torch.randn(2, 3, 8, 8)
    results = []
    for dev in ("cpu", "rgpu"):
        model = copy.deepcopy(net).to(dev)
        out = model(x.to(dev))
        out.sum().backward()
        results.append([out.detach().cpu()] + [p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*results):  # 1e-4: a GPU server's kernels (cuDNN) sum in another order
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("shape, causal", [((2, 3, 16, 8), True), ((1, 2, 33, 16), False)])
def test_attention_runs_fused_on_the_server_with_the_cpus_values_and_gradients(rgpu_device, shape, causal):
    torch.manual_seed(0)
    qkv = [torch.randn(*shape) for _ in range(3)]
    results = []
    for dev in ("cpu", "rgpu"):
        q, k, v = (t.detach().to(dev).requires_grad_() for t in qkv)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.sum().backward()
        results.append([out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()])
        if dev == "rgpu":  # not the math path's T x T matrices
            assert "FusedAttentionOverrideable" in type(out.grad_fn).__name__
    for a, b in zip(*results):  # 1e-4: a GPU server runs another fused kernel than the CPU
        assert torch.allclose(a, b, atol=1e-4)


def test_an_out_tensor_of_the_wrong_size_is_resized_with_pytorchs_warning_as_on_cuda(rgpu_device):
    a, out = torch.ones(3, device="rgpu"), torch.zeros(2, device="rgpu")
    with pytest.warns(UserWarning, match="was resized"):
        torch.add(a, a, out=out)
    assert out.shape == (3,) and out.cpu().tolist() == [2.0, 2.0, 2.0]
