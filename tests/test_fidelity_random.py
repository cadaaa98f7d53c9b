"""Random numbers on rgpu: seeds reach the server, generator objects and their states, runs that repeat."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from device_helpers import rgpu_device, run_python  # noqa: F401


def _draws(generator=None) -> list[torch.Tensor]:
    """One of each random op the issue names (and a few more), downloaded."""
    g = {"generator": generator} if generator is not None else {}
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], device="rgpu")
    out = [
        torch.randn(5, device="rgpu", **g),
        torch.rand(5, device="rgpu", **g),
        torch.randint(0, 100, (5,), device="rgpu", **g),
        torch.multinomial(p, 6, replacement=True, **g),
        torch.bernoulli(torch.full((16,), 0.5, device="rgpu"), **g),
        torch.empty(5, device="rgpu").normal_(**g),
        torch.randperm(8, device="rgpu", **g),
    ]
    if generator is None:  # dropout takes no generator: the device's default one
        out.append(F.dropout(torch.ones(32, device="rgpu"), 0.5))
    return [t.cpu() for t in out]


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("seed_fn", [torch.manual_seed, torch.rgpu.manual_seed, torch.rgpu.manual_seed_all])
def test_seeding_the_default_generator_repeats_every_random_op(rgpu_device, seed_fn):
    seed_fn(1234)
    first = _draws()
    seed_fn(1234)
    assert _equal(first, _draws())
    assert not _equal(first, _draws())  # the stream moves on
    assert torch.rgpu.initial_seed() == 1234


def test_two_generators_seeded_alike_give_equal_streams_unlike_the_default_one(rgpu_device):
    g1, g2 = torch.Generator("rgpu"), torch.Generator("rgpu")
    assert g1.device == torch.device("rgpu", 0)
    g1.manual_seed(7)
    g2.manual_seed(7)
    a, b = _draws(g1), _draws(g2)
    assert _equal(a, b)
    torch.manual_seed(7)
    assert not torch.equal(a[0], torch.randn(5, device="rgpu").cpu())
    assert not _equal(a, _draws(g1))  # each use draws new numbers


def test_a_generators_state_round_trips_through_get_state_and_set_state(rgpu_device):
    g = torch.Generator("rgpu").manual_seed(99)
    _draws(g)
    state = g.get_state()
    after = _draws(g)
    g.set_state(state)
    assert _equal(after, _draws(g))
    clone = torch.Generator("rgpu")
    clone.set_state(state)
    assert _equal(after, _draws(clone))


def test_a_cpu_generator_for_a_device_op_is_refused_as_on_cuda(rgpu_device):
    with pytest.raises(RuntimeError, match="Expected a 'rgpu' device type for generator"):
        torch.randn(3, device="rgpu", generator=torch.Generator())


_RUN = """
import torch, rgpu
import torch.nn.functional as F
torch.manual_seed(2024)
g = torch.Generator("rgpu").manual_seed(5)
p = torch.tensor([0.1, 0.2, 0.7], device="rgpu")
draws = [torch.randn(4, device="rgpu"), torch.randint(0, 9, (4,), device="rgpu"), torch.multinomial(p, 4, True),
         torch.bernoulli(torch.full((8,), 0.5, device="rgpu")), F.dropout(torch.ones(8, device="rgpu"), 0.5),
         torch.randn(4, device="rgpu", generator=g)]
print([t.cpu().tolist() for t in draws])
"""


def test_random_ops_repeat_from_one_run_to_the_next(rgpu_server):
    env = {"RGPU_SERVER": rgpu_server.address, "RGPU_TOKEN": rgpu_server.token}
    runs = [run_python(_RUN, env=env) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()


def test_the_devices_random_state_round_trips_and_checkpointing_replays_dropout(rgpu_device):
    torch.manual_seed(0)
    state = torch.rgpu.get_rng_state()
    first = _draws()
    torch.rgpu.set_rng_state(state)
    assert state.dtype == torch.uint8 and _equal(first, _draws())
    assert len(torch.rgpu.get_rng_state_all()) == torch.rgpu.device_count()
    lin = torch.nn.Linear(8, 8).to("rgpu")
    x = torch.randn(4, 8, device="rgpu", requires_grad=True)
    grads = []
    for ckpt in (True, False):  # the recomputed forward must draw the forward's dropout mask again
        torch.manual_seed(1)
        fn = lambda t: F.dropout(lin(t), 0.5, training=True)  # noqa: E731
        y = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False) if ckpt else fn(x)
        y.sum().backward()
        grads.append(x.grad.cpu())
        x.grad = None
    assert torch.equal(grads[0], grads[1])
