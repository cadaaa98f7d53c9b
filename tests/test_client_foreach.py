"""Foreach ops over lists of tensors (an optimizer's step) stream from the C++ fast path and match the CPU, value by value."""
from __future__ import annotations

import pytest
import torch
from device_helpers import rgpu_device  # noqa: F401

SHAPES = [(3, 4), (5,), (2, 3, 2), (1,), (4, 1)]


def _lists(dtypes):
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(s, generator=gen).abs().add(0.1).to(d) for s, d in zip(SHAPES, dtypes)] for _ in range(3)]


def _ops(a, b, c, scale):
    """A mix of AdamW's foreach ops and their other overloads; returns what they made, in place or new."""
    torch._foreach_mul_(a, 0.9)
    torch._foreach_add_(a, b, alpha=-0.5)
    torch._foreach_add_(b, 0.25)
    torch._foreach_lerp_(a, b, 0.1)
    torch._foreach_addcmul_(b, a, c, value=0.01)
    torch._foreach_addcdiv_(c, a, b, [0.1 * (i + 1) for i in range(len(a))])  # a ScalarList
    torch._foreach_mul_(c, scale)  # a 0-dim tensor on the device
    roots = torch._foreach_sqrt(b)
    torch._foreach_div_(roots, [1.5] * len(roots))
    sums = torch._foreach_add(a, roots)
    norms = torch._foreach_norm(c)
    return [*a, *b, *c, *roots, *sums, *norms]


@pytest.mark.parametrize("dtypes", [
    [torch.float32] * len(SHAPES),
    [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32]], ids=["float32", "mixed"])
def test_foreach_ops_hit_the_fast_path_once_warm_and_match_the_cpu(rgpu_device, dtypes):  # noqa: F811
    C = rgpu_device.C
    cpu = _lists(dtypes)
    dev = [[t.to("rgpu") for t in lst] for lst in cpu]
    for step in range(3):  # the first call of each signature is Python's; later ones C++'s
        if step == 2:
            C.fast_path_stats(reset=True)
        scale = 1.0 - 0.1 * step  # in-place ops key floats by type: a new value still hits
        want = _ops(*cpu, torch.tensor(scale))
        got = _ops(*dev, torch.tensor(scale).to("rgpu"))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g.cpu(), w, rtol=1e-6, atol=1e-7)
    stats = C.fast_path_stats()
    assert stats["misses"] == 0 and stats["hits"] >= 11, stats
