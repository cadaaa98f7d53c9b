"""Ops stream: only data waits. Round trips per training step and per op chain are pinned here."""
from __future__ import annotations

import pytest
import torch
from device_helpers import rgpu_device, tiny_gpt  # noqa: F401

import rgpu


def _step(model, opt, x, y):
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_step_that_reads_its_loss_costs_one_round_trip(rgpu_device, dtype):
    model = tiny_gpt().to("rgpu", dtype=dtype)
    opt = model.configure_optimizer(1e-3)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 97, (2, 4, 16), generator=gen) for _ in range(3)]
    for b in batches[:2]:  # the first steps define ops and fill the meta cache
        _step(model, opt, *b.to("rgpu"))
    rgpu.stats(reset=True)
    _step(model, opt, *batches[2].to("rgpu"))
    counts = rgpu.stats()
    assert counts["round_trips"] == 1, counts
    assert counts["messages"] > 20


def test_a_chain_of_ops_ending_in_cpu_costs_one_round_trip(rgpu_device):
    x = torch.randn(64, 64).to("rgpu")
    rgpu.stats(reset=True)
    y = x
    for _ in range(50):
        y = torch.relu(y @ x * 0.01 + 1.0)
    y.cpu()
    counts = rgpu.stats()
    assert counts["round_trips"] == 1 and counts["messages"] >= 150, counts


def test_frees_ride_along_with_the_next_message(rgpu_device):
    x = torch.ones(16).to("rgpu")
    rgpu.stats(reset=True)
    for _ in range(100):
        y = x * 2  # each iteration frees the previous y
    del y
    torch.rgpu.synchronize()
    counts = rgpu.stats()
    assert counts["messages"] <= 100 + 2, counts  # 100 ops, the events flush, the sync


def test_ids_are_minted_on_the_client_and_outputs_need_no_answer(rgpu_device):
    x = torch.ones(3).to("rgpu")
    rgpu.stats(reset=True)
    y = x + 1
    z = y.sum()
    assert rgpu.stats()["round_trips"] == 0
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert z.item() == 6.0


def test_a_step_with_a_grad_scaler_costs_two_round_trips_as_on_cuda(rgpu_device):
    model = tiny_gpt().to("rgpu")  # fp32 parameters, as under autocast (which the fidelity issue adds)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("rgpu")
    x = torch.randint(0, 97, (2, 16)).to("rgpu")
    for i in range(3):
        if i == 2:
            rgpu.stats(reset=True)
        _, loss = model(x, x)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)  # reads found_inf: a wait, as on CUDA
        scaler.update()
        loss.item()
    assert rgpu.stats()["round_trips"] == 2
