"""Attention and convolution on rgpu give the CPU's values and gradients; unmasked attention runs fused."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from device_helpers import rgpu_device  # noqa: F401

# Tolerances that hold on a GPU server too (cuDNN and fused kernels sum in other orders).
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _leaves(tensors, device, dtype):
    return [t.detach().to(device, dtype).requires_grad_() for t in tensors]


def _attention(qkv, device, dtype, **kw):
    q, k, v = _leaves(qkv, device, dtype)
    mask = kw.pop("mask", None)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(device), **kw)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device=device)).sum().backward()
    return out, [out.detach().cpu().float()] + [t.grad.cpu().float() for t in (q, k, v)]


ATTENTION = {  # name: (q shape, kv length, keyword arguments)
    "causal": ((2, 3, 16, 8), 16, {"is_causal": True}),
    "odd length": ((1, 2, 33, 16), 33, {}),
    "cross (kv longer)": ((2, 2, 5, 32), 9, {}),
    "scaled": ((1, 1, 12, 64), 12, {"is_causal": True, "scale": 0.3}),
    "bool mask": ((2, 2, 6, 8), 10, {"mask": torch.rand(6, 10) > 0.3}),
    "float mask": ((1, 2, 7, 16), 7, {"mask": torch.randn(1, 2, 7, 7)}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention_values_and_gradients_match_the_cpu(rgpu_device, case, dtype):
    shape, kv_len, kw = ATTENTION[case]
    torch.manual_seed(0)
    b, h, t, d = shape
    qkv = [torch.randn(b, h, t, d), torch.randn(b, h, kv_len, d), torch.randn(b, h, kv_len, d)]
    out, got = _attention(qkv, "rgpu", dtype, **dict(kw))
    _, expected = _attention(qkv, "cpu", dtype, **dict(kw))
    for a, e in zip(got, expected):
        assert torch.allclose(a, e, atol=TOL[dtype], rtol=TOL[dtype]), (case, (a - e).abs().max())
    fused = "FusedAttentionOverrideable" in type(out.grad_fn).__name__
    assert fused == ("mask" not in kw)  # a mask takes the math path (see device_backend/attention.cpp)


@pytest.mark.parametrize("case", ["rows 9 floats apart (a column slice)", "float64"])
def test_attention_the_fused_kernel_cannot_read_takes_the_math_path_and_matches_the_cpu(rgpu_device, case):
    """CUDA's memory-efficient kernel reads rows as 16-byte vectors and takes float, half and bfloat16 only
    (natively too, a query like the first fails there): such inputs go the math path on every server alike."""
    torch.manual_seed(0)
    wide, dtype = (9, torch.float32) if case.startswith("rows") else (8, torch.float64)
    base, k, v = torch.randn(2, 2, 6, wide), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    got = {}
    for device in ("rgpu", "cpu"):
        q = base.to(device, dtype)[..., :8].detach().requires_grad_()
        out = F.scaled_dot_product_attention(q, k.to(device, dtype), v.to(device, dtype), is_causal=True)
        out.sum().backward()
        got[device] = (out.detach().cpu(), q.grad.cpu(), type(out.grad_fn).__name__)
    assert "FusedAttentionOverrideable" not in got["rgpu"][2]
    for a, e in zip(got["rgpu"][:2], got["cpu"][:2]):
        assert torch.allclose(a, e, atol=1e-5, rtol=1e-5), (case, (a - e).abs().max())


CONVOLUTIONS = {
    "1-d, strided": lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1),
    "2-d, grouped and dilated": lambda: nn.Conv2d(4, 6, 3, groups=2, dilation=2, padding=2),
    "2-d, same padding, no bias": lambda: nn.Conv2d(2, 3, (3, 2), padding="same", bias=False),
    "3-d, strided": lambda: nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 2)),
    "1-d transposed, output padding": lambda: nn.ConvTranspose1d(4, 2, 3, stride=2, output_padding=1),
    "2-d transposed, grouped": lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, groups=2, padding=1),
    "2-d transposed, dilated": lambda: nn.ConvTranspose2d(2, 3, 2, dilation=2),
    "3-d transposed": lambda: nn.ConvTranspose3d(2, 3, 2, stride=2),
}
_INPUTS = {1: (2, 0, 9), 2: (2, 0, 7, 6), 3: (1, 0, 4, 6, 5)}


@pytest.mark.parametrize("case", list(CONVOLUTIONS))
def test_convolution_values_and_gradients_match_the_cpu(rgpu_device, case):
    torch.manual_seed(0)
    conv = CONVOLUTIONS[case]()
    dims = conv.weight.dim() - 2
    shape = list(_INPUTS[dims])
    shape[1] = conv.in_channels
    x = torch.randn(shape)
    results = []
    for device in ("cpu", "rgpu"):
        layer = copy.deepcopy(conv).to(device)
        xi = x.detach().to(device).requires_grad_()
        out = layer(xi)
        (out * torch.linspace(-1, 1, out.shape[-1], device=device)).sum().backward()
        grads = [p.grad.cpu() for p in layer.parameters()]
        results.append([out.detach().cpu(), xi.grad.cpu(), *grads])
    for a, e in zip(results[1], results[0]):
        assert a.shape == e.shape and torch.allclose(a, e, atol=1e-4, rtol=1e-4), case


def test_convolution_under_bfloat16_matches_the_cpu(rgpu_device):
    torch.manual_seed(0)
    conv, x = nn.Conv2d(3, 4, 3, padding=1).to(torch.bfloat16), torch.randn(1, 3, 6, 6, dtype=torch.bfloat16)
    expected = conv(x)
    got = conv.to("rgpu")(x.to("rgpu")).cpu()
    assert torch.allclose(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
