"""The substitutes both ends run for ops PyTorch leaves without a kernel on a third-party device.

The client sizes a substitute's outputs on meta tensors (eager) or through the op's own meta
(torch.compile traces with that): the two must agree, or a compiled graph's outputs come back in
shapes the client did not trace (memory-efficient attention pads its logsumexp to 32 rows).
"""
from __future__ import annotations

import pytest
import torch

from rgpu.ops_substitutes import SUBSTITUTES, substitute

FWD = "_scaled_dot_product_fused_attention_overrideable.default"
BWD = "_scaled_dot_product_fused_attention_overrideable_backward.default"


def _meta(*shape):
    return torch.empty(*shape, device="meta")


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
@pytest.mark.parametrize("rows", [16, 32, 40])
def test_attention_outputs_are_sized_as_the_ops_own_meta_says(kind, rows):
    # shapes and dtypes; a layout that differs costs the server a copy into the client's (graphs._bind)
    q = _meta(2, 3, rows, 16)
    got = substitute(FWD, kind)(q, q, q, None, 0.0, False)
    want = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default(q, q, q, None, 0.0, False)
    for g, w in zip(got[:2], want[:2]):
        assert g.shape == w.shape and g.dtype == w.dtype


@pytest.mark.parametrize("rows", [16, 40])
def test_the_cuda_backward_takes_the_cut_logsumexp(rows):
    q = _meta(2, 3, rows, 16)
    out = substitute(FWD, "cuda")(q, q, q, None, 0.0, True)
    grads = substitute(BWD, "cuda")(q, q, q, q, None, [True, True, True, False], out[0], out[1], None, None,
                                    rows, rows, 0.0, True, out[6], out[7])
    assert [g.shape for g in grads[:3]] == [q.shape] * 3


def test_every_substitute_has_both_kinds():
    assert all(set(table) == {"cuda", "cpu"} for table in SUBSTITUTES.values())
