"""Autocast on rgpu follows CUDA's policy, and GradScaler trains in float16 to the CPU's float32 losses."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from device_helpers import rgpu_device  # noqa: F401

import rgpu


def test_the_device_module_names_the_dtypes_autocast_takes(rgpu_device):
    assert torch.rgpu.get_amp_supported_dtype() == [torch.float16, torch.bfloat16]
    assert torch.amp.is_autocast_available("rgpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_matmuls_run_in_the_lower_precision_and_softmax_in_float32(rgpu_device, dtype):
    a, b = torch.randn(4, 4, device="rgpu"), torch.randn(4, 4, device="rgpu")
    conv, x = torch.nn.Conv1d(2, 3, 3).to("rgpu"), torch.randn(1, 2, 8, device="rgpu")
    with torch.autocast("rgpu", dtype=dtype):
        assert (a @ b).dtype == dtype and F.linear(a, b).dtype == dtype and conv(x).dtype == dtype
        assert torch.softmax(a, -1).dtype == torch.float32  # CUDA's fp32 list
        assert F.layer_norm(a.to(dtype), (4,)).dtype == torch.float32
        assert (a + b).dtype == torch.float32  # not on any list: untouched
        assert torch.addcmul(a.to(dtype), a, b).dtype == torch.float32  # promote: the widest input
    assert (a @ b).dtype == torch.float32  # and nothing outside the region


def test_autocast_refuses_binary_cross_entropy_as_cuda_does(rgpu_device):
    p, y = torch.rand(4, device="rgpu"), torch.rand(4, device="rgpu")
    with torch.autocast("rgpu", dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, y)


def _train(net, batches, device: str, amp: bool):
    model = copy.deepcopy(net).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a scale float16 gradients can hold from the first step: no step skipped, so the CPU's steps compare
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, enabled=amp)
    losses, round_trips = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16, enabled=amp):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        before = rgpu.stats()["round_trips"]
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        round_trips.append(rgpu.stats()["round_trips"] - before)
        assert not amp or scaler.get_scale() == 2.0 ** 10  # no inf/NaN found, no step skipped
    return losses, round_trips


def test_grad_scaler_trains_in_float16_to_the_cpus_float32_losses_in_two_round_trips_a_step(rgpu_device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]
    reference, _ = _train(net, batches, "cpu", amp=False)
    losses, round_trips = _train(net, batches, "rgpu", amp=True)
    # float16 matmuls keep about 3 decimal digits: 1e-2 relative holds on any server
    assert losses == pytest.approx(reference, rel=1e-2, abs=1e-3)
    assert round_trips == [2] * len(batches)  # the optimizer's found_inf check, then loss.item()
