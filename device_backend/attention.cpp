// attention.cpp: the fused-attention choice for PrivateUse1 (ATen's _fused_sdp_choice_stub).
//
// Answering "overrideable" sends F.scaled_dot_product_attention to
// _scaled_dot_product_fused_attention_overrideable (and its backward), which
// the server runs as a fused kernel (memory-efficient attention on CUDA, flash
// on the CPU) instead of the math path's T x T matrices. Cases those kernels
// do not take the same way on every server stay on the math path.
#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>

namespace rgpu {
namespace {

// CUDA's memory-efficient kernel reads rows as 128-bit vectors: the offset and every stride but the last
// must be whole vectors ("query is not correctly aligned (strideM)" otherwise, natively too), and it takes
// float, half and bfloat16 only.
bool fits_the_kernel(const at::Tensor& t) {
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kHalf && t.scalar_type() != at::kBFloat16) return false;
  const int64_t vector = 16 / static_cast<int64_t>(t.element_size());
  if (t.storage_offset() % vector != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) % vector != 0) return false;
  return true;
}

int64_t choose(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
               std::optional<double> scale, bool enable_gqa) {
  auto math = static_cast<int64_t>(at::SDPBackend::math);
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || (mask.has_value() && mask->defined()) ||
      dropout_p > 0.0 || enable_gqa || !fits_the_kernel(q) || !fits_the_kernel(k) || !fits_the_kernel(v)) {
    return math;
  }
  auto d = q.size(-1);
  if (d > 128 || d % 8 != 0 || v.size(-1) != d || q.stride(-1) != 1 || k.stride(-1) != 1 || v.stride(-1) != 1) {
    return math;
  }
  return static_cast<int64_t>(at::SDPBackend::overrideable);
}

}  // namespace
}  // namespace rgpu

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &rgpu::choose);
}
