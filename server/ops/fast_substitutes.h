// The fused attention substitutes of rgpu/ops_substitutes.py, for the op path in fast_op.cpp.
//
// PyTorch sends a PrivateUse1 device's scaled dot product attention to "overrideable" ops whose only kernels
// raise; the server runs a substitute instead. In Python each call cost the GPU host more than its own aten
// work, 12 calls a step of the bench's nanoGPT (docs/perf/fast_path-history.md, run12). Here are the same
// substitutes on the stack the overrideable op's schema parsed: ops_substitutes.py stays the reference (the
// client sizes its outputs with it; tests/test_server_fast_op.py compares both paths value by value), and an
// overrideable op without a recipe here is never defined on this path.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/stack.h>

#include <array>
#include <optional>
#include <stdexcept>
#include <string>

namespace rgpu_server {

// A substitute: the overrideable op's arguments on ``stack`` (as its schema parsed them; an undefined
// tensor, which these schemas take where they say Tensor, as None) become its returns.
using Recipe = void (*)(torch::jit::Stack& stack);

namespace recipes {

inline std::optional<at::Tensor> opt_tensor(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<at::Tensor>(v.toTensor());
}
inline at::Tensor or_undefined(const c10::IValue& v) { return v.isNone() ? at::Tensor() : v.toTensor(); }
inline std::optional<double> opt_double(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<double>(v.toDouble());
}

// _scaled_dot_product_fused_attention_overrideable(q, k, v, attn_bias, dropout_p, is_causal,
// return_debug_mask, *, scale) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
// philox_offset, debug_attn_mask)

// CUDA: memory-efficient attention, its logsumexp cut from a multiple of 32 rows to the op's (_sdpa_cuda).
inline void sdpa_cuda(torch::jit::Stack& s) {
  auto a = torch::jit::pop(s, 8);
  const at::Tensor &q = a[0].toTensor(), &k = a[1].toTensor();
  auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(
      q, k, a[2].toTensor(), opt_tensor(a[3]), true, a[4].toDouble(), a[5].toBool(), opt_double(a[7]));
  const int64_t rows = q.size(-2);
  if (lse.size(-1) != rows) lse = lse.narrow(-1, 0, rows).contiguous();
  torch::jit::push(s, out, lse, c10::IValue(), c10::IValue(), rows, k.size(-2), seed, offset, c10::IValue());
}

// CPU: flash attention for the CPU (_sdpa_cpu).
inline void sdpa_cpu(torch::jit::Stack& s) {
  auto a = torch::jit::pop(s, 8);
  const at::Tensor &q = a[0].toTensor(), &k = a[1].toTensor();
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, a[2].toTensor(), a[4].toDouble(),
                                                                     a[5].toBool(), opt_tensor(a[3]), opt_double(a[7]));
  torch::jit::push(s, out, lse, c10::IValue(), c10::IValue(), q.size(-2), k.size(-2), c10::IValue(), c10::IValue(),
                   c10::IValue());
}

// _scaled_dot_product_fused_attention_overrideable_backward(grad_out, q, k, v, attn_bias, grad_input_mask,
// out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
// *, scale) -> (grad_query, grad_key, grad_value, grad_attn_bias)

// CUDA: the logsumexp padded back to the kernel's blocks of 32 rows (_sdpa_cuda_backward).
inline void sdpa_cuda_backward(torch::jit::Stack& s) {
  auto a = torch::jit::pop(s, 17);
  at::Tensor lse = a[7].toTensor();
  const int64_t padded = (lse.size(-1) + 31) / 32 * 32;
  if (padded != lse.size(-1)) lse = at::constant_pad_nd(lse, {0, padded - lse.size(-1)}, 0.0);
  auto mask = a[5].toBoolList();
  if (mask.size() != 4) throw std::invalid_argument("grad_input_mask: 4 bools expected");
  std::array<bool, 4> grads{mask[0], mask[1], mask[2], mask[3]};
  auto [gq, gk, gv, gb] = at::_scaled_dot_product_efficient_attention_backward(
      a[0].toTensor(), a[1].toTensor(), a[2].toTensor(), a[3].toTensor(), or_undefined(a[4]), a[6].toTensor(), lse,
      a[14].toTensor(), a[15].toTensor(), a[12].toDouble(), grads, a[13].toBool(), opt_double(a[16]));
  torch::jit::push(s, gq, gk, gv, gb);
}

// CPU (_sdpa_cpu_backward).
inline void sdpa_cpu_backward(torch::jit::Stack& s) {
  auto a = torch::jit::pop(s, 17);
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      a[0].toTensor(), a[1].toTensor(), a[2].toTensor(), a[3].toTensor(), a[6].toTensor(), a[7].toTensor(),
      a[12].toDouble(), a[13].toBool(), opt_tensor(a[4]), opt_double(a[16]));
  torch::jit::push(s, gq, gk, gv, c10::IValue());
}

}  // namespace recipes

// The recipe for ``qualified`` ("name.overload") on a server whose device is CUDA (or the CPU); nullptr if none.
inline Recipe recipe_for(const std::string& qualified, bool on_cuda) {
  if (qualified == "_scaled_dot_product_fused_attention_overrideable.default")
    return on_cuda ? recipes::sdpa_cuda : recipes::sdpa_cpu;
  if (qualified == "_scaled_dot_product_fused_attention_overrideable_backward.default")
    return on_cuda ? recipes::sdpa_cuda_backward : recipes::sdpa_cpu_backward;
  return nullptr;
}

}  // namespace rgpu_server
