// The packed bfloat16 weight layout shared by bf16_gemm.cpp (AVX-512 BF16), amx_gemm.cpp (AMX) and
// bf16_gemm_avx2.cpp (AVX2 + FMA).
//
// Outputs in blocks of 16 (zero rows pad the last block), each block contiguous over K as
// [K / 2][16 outputs][2 columns] bfloat16: one 64-byte row is 16 outputs x 2 columns. That is
// vdpbf16ps's operand (the outputs in the lanes) and, 16 rows at a time, AMX's B tile for
// tdpbf16ps (16 column pairs x 16 outputs).
#pragma once

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pagedllm_bf16 {

constexpr int64_t kBlock = 16;   // outputs per packed block (zmm float32 lanes, B tile columns)
constexpr int64_t kPair = 2;     // columns per lane

inline void check_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.dtype() == at::kBFloat16 && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kPair * kBlock,
              "packed must be a contiguous bfloat16 [N / 16, K / 2, 32] tensor from pack_bf16_weight");
  TORCH_CHECK(packed.size(1) * kPair == k, "packed does not match K=", k);
  TORCH_CHECK(packed.size(0) * kBlock >= n && packed.size(0) * kBlock < n + kBlock, "packed does not match N=", n);
}

// w [N, K] bfloat16 (K even) -> packed [ceil(N / 16), K / 2, 32] bfloat16 in the layout above.
inline at::Tensor pack_bf16_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dtype() == at::kBFloat16 && w.dim() == 2, "w must be a bfloat16 [N, K] tensor");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kPair == 0 && k > 0, "K must be a positive even number, got ", k);
  const int64_t blocks = (n + kBlock - 1) / kBlock, k2 = k / kPair;
  auto wc = w.contiguous();
  auto packed = cpu_tensor::empty({blocks, k2, kPair * kBlock}, w.scalar_type());
  packed.zero_();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < kBlock && b * kBlock + r < n; ++r) {
        const uint16_t* row = src + (b * kBlock + r) * k;
        uint16_t* out = dst + b * k2 * kPair * kBlock + kPair * r;
        for (int64_t c = 0; c < k2; ++c) {
          out[c * kPair * kBlock] = row[kPair * c];
          out[c * kPair * kBlock + 1] = row[kPair * c + 1];
        }
      }
    }
  });
  return packed;
}

}  // namespace pagedllm_bf16
