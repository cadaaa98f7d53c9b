"""Which small attention shapes CUDA's memory-efficient kernel refuses ("query is not correctly aligned (strideM)"),
natively, and the layouts rgpu's client gives the same tensors. One line per case on stdout.

    python tools/diag/probe_sdpa_align.py        (on the GPU host, rgpu installed; run outside the tree)
"""
import torch

eff = torch.ops.aten._scaled_dot_product_efficient_attention.default


def native(shape, stride=None):
    q = torch.randn(shape, device="cuda")
    if stride is not None:
        q = torch.empty_strided(shape, stride, device="cuda").copy_(q)
    try:
        eff(q, q * 0.5, q, None, True, 0.0, True)
        return "ok"
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:80]


for shape in [(1, 1, 4, 8), (1, 1, 2, 8), (5, 1, 2, 8), (1, 2, 4, 8), (2, 6, 256, 64), (1, 1, 4, 16), (1, 1, 4, 32)]:
    print("native contiguous", shape, native(shape))
import rgpu  # noqa: E402,F401

d = torch.randn(4, 9).to("rgpu")
q = d[:, :8].reshape(1, 1, 4, 8)
print("rgpu q", tuple(q.shape), q.stride(), q.storage_offset(), "k", (q * 0.5).stride())
print("native with rgpu's strides", native(tuple(q.shape), q.stride()))
h = torch.randn(5, 16).to("rgpu").view(5, 1, 2, 8)
print("rgpu h", tuple(h.shape), h.stride(), "->", native(tuple(h.shape), h.stride()))
