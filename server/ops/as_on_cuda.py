"""CPU kernels made to answer as CUDA's do, for the CPU executor.

The client sizes every output with meta kernels, which follow CUDA. Where a CPU
kernel wants other argument dtypes, ``CPU_ADAPT`` adapts its arguments first;
where it returns other shapes or dtypes, ``CPU_RESULTS`` adapts its results.
"""
from __future__ import annotations

import torch


def _layer_norm_stats_like_input(a: list) -> list:
    a[3], a[4] = a[3].to(a[1].dtype), a[4].to(a[1].dtype)
    return a


def _batch_norm_stats_as_on_cuda(a: list, result):
    # in eval mode the CPU kernel saves no statistics; CUDA's returns C of them (the backward reads neither)
    out, mean, invstd = result
    if mean.numel() == 0 and a[0].dim() > 1:
        mean = invstd = torch.zeros(a[0].shape[1], dtype=torch.float32)
    return out, mean, invstd


def _embedding_bag_as_on_cuda(a: list, result):
    # the CPU's sum-mode fast path leaves offset2bag empty, and its backward then rebuilds it; CUDA's fills
    # it, so the client sized it, and the backward here must then get the real one: ATen's make_offset2bag.
    # Outside max mode the CPU returns max_indices of one per bag, CUDA none; with include_last_offset
    # CUDA's bag_size has one per offset, the CPU's one per bag.
    out, offset2bag, bag_size, max_indices = result
    indices, offsets = a[1], a[2]
    if (a[4] if len(a) > 4 else 0) != 2:
        max_indices = max_indices.new_empty(0)
    if bag_size.numel() < offsets.numel():
        bag_size = torch.cat([bag_size, bag_size.new_zeros(offsets.numel() - bag_size.numel())])
    if offset2bag.numel() == 0 and indices.numel():
        if out.shape[0] == offsets.numel() - 1:  # include_last_offset
            offsets = offsets[:-1]
        offset2bag = torch.zeros(indices.numel() + 1, dtype=indices.dtype)
        offset2bag.index_add_(0, offsets.to(indices.dtype), torch.ones_like(offsets, dtype=indices.dtype))
        offset2bag[0] -= 1
        offset2bag = offset2bag.cumsum(0)[:-1]
    return out, offset2bag, bag_size, max_indices


# op name -> adapt(args) -> args: where a CPU kernel wants other dtypes (reduced-precision inputs)
CPU_ADAPT = {
    # CUDA keeps mean/rstd in float32 for bf16/fp16 inputs; the CPU backward wants the input's dtype
    "aten.native_layer_norm_backward.default": _layer_norm_stats_like_input,
}
# op name -> fix(args, result) -> result: where a CPU kernel returns other shapes
CPU_RESULTS = {
    "aten.native_batch_norm.default": _batch_norm_stats_as_on_cuda,
    "aten._native_batch_norm_legit.default": _batch_norm_stats_as_on_cuda,
    "aten._native_batch_norm_legit_no_training.default": _batch_norm_stats_as_on_cuda,
    "aten._embedding_bag.default": _embedding_bag_as_on_cuda,
    "aten._embedding_bag_forward_only.default": _embedding_bag_as_on_cuda,
}
