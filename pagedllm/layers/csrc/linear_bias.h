// The optional float32 bias of the project's GEMM extensions (bf16_gemm.cpp, amx_gemm.cpp,
// f32_gemm.cpp): checked once, read through a raw pointer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedllm_linear {

// bias [N] float32 or None -> its data (nullptr for None); `keep` holds the contiguous copy the
// pointer reads, for the call's lifetime.
inline const float* bias_pointer(const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dtype() == at::kFloat && bias->numel() == n, "bias must be a float32 [N] tensor");
  keep = bias->contiguous();
  return keep.data_ptr<float>();
}

}  // namespace pagedllm_linear
