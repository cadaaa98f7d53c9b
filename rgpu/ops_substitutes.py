"""Ops a third-party device reaches with no kernel anywhere, and what each end runs instead.

PyTorch sends convolution and fused attention on a PrivateUse1 device to
"overrideable" ops whose only kernels raise. The client claims them and sizes
their outputs by calling the substitute below on meta tensors; the server calls
the same substitute on real ones. Both ends read this one table (here, in
neither end's package), picking by
the server's kind of device ("cuda" or "cpu"), so the outputs the client
mints always match what the server makes. ``aten`` is ``torch.ops.aten``.
"""
from __future__ import annotations


def _convolution(aten, *a):
    return aten.convolution.default(*a)


def _convolution_backward(aten, grad_output, input, weight, *a):
    transposed, groups = a[3], a[5]
    bias_sizes = [weight.shape[1] * groups] if transposed else [weight.shape[0]]
    return aten.convolution_backward.default(grad_output, input, weight, bias_sizes, *a)


def _sdpa_cuda(aten, q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
               scale=None):
    # memory-efficient attention: every float dtype, what native CUDA picks for fp32. Its logsumexp is
    # padded to a multiple of 32 rows; the overrideable op's own meta (what torch.compile traces with)
    # says (batch, heads, rows): cut to that, so eager and compiled clients size it alike
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(
        q, k, v, attn_bias, True, dropout_p, is_causal, scale=scale)
    rows = q.shape[-2]
    if lse.shape[-1] != rows:
        lse = lse[..., :rows].contiguous()
    return out, lse, None, None, rows, k.shape[-2], seed, offset, None


def _sdpa_cuda_backward(aten, grad_out, q, k, v, attn_bias, grad_input_mask, out, lse, cum_q, cum_k, max_q,
                        max_k, dropout_p, is_causal, seed, offset, *, scale=None):
    padded = -(-lse.shape[-1] // 32) * 32     # the kernel reads the rows in blocks of 32: pad back
    if padded != lse.shape[-1]:
        lse = aten.constant_pad_nd.default(lse, [0, padded - lse.shape[-1]], 0.0)
    return aten._scaled_dot_product_efficient_attention_backward.default(
        grad_out, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal, scale=scale)


def _sdpa_cpu(aten, q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
              scale=None):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
    return out, lse, None, None, q.shape[-2], k.shape[-2], None, None, None


def _sdpa_cpu_backward(aten, grad_out, q, k, v, attn_bias, grad_input_mask, out, lse, cum_q, cum_k, max_q,
                       max_k, dropout_p, is_causal, seed, offset, *, scale=None):
    gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
    return gq, gk, gv, None


# "name.overload" -> {server device kind: substitute(aten, *args, **kwargs)}
SUBSTITUTES = {
    "convolution_overrideable.default": {"cuda": _convolution, "cpu": _convolution},
    "convolution_backward_overrideable.default": {"cuda": _convolution_backward, "cpu": _convolution_backward},
    "_scaled_dot_product_fused_attention_overrideable.default": {"cuda": _sdpa_cuda, "cpu": _sdpa_cpu},
    "_scaled_dot_product_fused_attention_overrideable_backward.default": {
        "cuda": _sdpa_cuda_backward, "cpu": _sdpa_cpu_backward},
}


def substitute(qualified: str, kind: str):
    """The function running ``qualified`` on a ``kind`` server, as ``fn(*args, **kwargs)``; None if none."""
    table = SUBSTITUTES.get(qualified)
    if table is None:
        return None
    import torch

    fn = table[kind]
    return lambda *args, **kwargs: fn(torch.ops.aten, *args, **kwargs)
