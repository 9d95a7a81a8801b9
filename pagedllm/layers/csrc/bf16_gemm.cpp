// bfloat16 GEMM for the few rows of a decode step, on CPUs with AVX-512 BF16 (vdpbf16ps).
//
//   y[m, n] = bf16( sum_k x[m, k] * w[n, k]  (+ bias[n]) ),   x, w bfloat16, sums in float32
//
// Why: at 1-32 rows a step's linear layers and LM head are bound by reading their weights once,
// and the kernel's job is to keep the two vdpbf16ps pipes busy while the weights stream in.
// oneDNN's packed bf16 inner product reaches about half the machine's vdpbf16ps rate there
// (docs/performance.md, session 10); this kernel keeps a tile of rows x 32 outputs in zmm
// accumulators and streams each weight tile once per row group, 4 KiB of it prefetched ahead.
//
// Arithmetic: each product x * w of two bfloat16 values is exact in float32, vdpbf16ps adds
// two of them to the float32 accumulator per lane (K / 2 steps, in k order), the bias (float32)
// is added last and the sum rounded to bfloat16 to nearest even (NaN stays NaN). vdpbf16ps
// treats subnormal inputs as zero and flushes subnormal results (Intel SDM, VDPBF16PS), as
// oneDNN's bf16 kernels on the same instruction do. A row's result does not depend on the other
// rows of the batch.
//
// Packed layout (pack_bf16_weight, bf16_pack.h): outputs in blocks of 16 (zero rows pad the last
// block), each block contiguous over K as [K / 2][16 outputs][2 columns] bfloat16: one 64-byte
// load is 16 outputs x 2 columns, vdpbf16ps's operand layout with the outputs in the lanes, so a
// block's result is 16 adjacent outputs (no horizontal sums). Threads (at::parallel_for) split pairs of
// blocks; a micro-kernel call holds up to kMaxRows rows x 2 blocks in zmm accumulators, and the
// row groups of one block pair follow each other (the pair is still in L2 for the second).

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include "linear_bias.h"

#include "bf16_pack.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGEDLLM_BF16_GEMM 1
#else
#define PAGEDLLM_BF16_GEMM 0
#endif

namespace {

using pagedllm_bf16::check_packed;
using pagedllm_bf16::kBlock;
using pagedllm_bf16::kPair;
using pagedllm_bf16::pack_bf16_weight;
constexpr int kT = 2;            // blocks per micro-kernel call (32 outputs)
constexpr int kMaxRows = 8;      // rows per micro-kernel call (x 2 blocks: 16 accumulators)
constexpr int64_t kPrefetchLines = 64;   // software prefetch distance: 64 lines x 64 bytes = 4 KiB

}  // namespace

#if PAGEDLLM_BF16_GEMM
namespace {

inline void store_bf16(c10::BFloat16* out, __m512 v, __mmask16 mask) {
  // round to nearest even; NaN stays a quiet NaN (vcvtneps2bf16 does both)
  _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// R rows (x rows m0.., row stride k) x T blocks starting at block b -> out rows m0.., columns
// b * 16 .. (b + T) * 16 (masked past n).
template <int R, int T>
void micro_kernel(const c10::BFloat16* x, int64_t k, const c10::BFloat16* packed, int64_t b, int64_t n,
                  const float* bias, c10::BFloat16* out, int64_t ldo, bool prefetch) {
  const int64_t k2 = k / kPair;
  const c10::BFloat16* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + r * k;
  const __m512i* wb[T];
  for (int t = 0; t < T; ++t)
    wb[t] = reinterpret_cast<const __m512i*>(packed + (b + t) * k2 * kPair * kBlock);
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k2; ++c) {
    __m512bh wv[T];
    // Each block's line kPrefetchLines ahead into L2 (the first row group only: the blocks are in
    // L2 for the others; hardware prefetchers stop at 4 KiB pages, this does not). Measured on the
    // model's 72 layer weights at 1-16 rows: 1.2-1.4x faster than prefetching the next call's
    // blocks into L1, as this kernel did before (docs/benchmarks.md, "float32 GEMM").
    if (prefetch)
      for (int t = 0; t < T; ++t) _mm_prefetch(reinterpret_cast<const char*>(wb[t] + c + kPrefetchLines), _MM_HINT_T1);
    for (int t = 0; t < T; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(wb[t] + c);
    for (int r = 0; r < R; ++r) {
      int32_t xpair;  // columns 2c, 2c + 1 of row r (memcpy: any alignment; compiles to a broadcast)
      std::memcpy(&xpair, xr[r] + kPair * c, sizeof xpair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xpair);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv, wv[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t n0 = (b + t) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, n - n0);
    if (valid <= 0) continue;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store_bf16(out + r * ldo + n0, _mm512_add_ps(acc[r][t], bv), mask);
  }
}

template <int T>
void rows_kernel(int rows, const c10::BFloat16* x, int64_t k, const c10::BFloat16* packed, int64_t b, int64_t n,
                 const float* bias, c10::BFloat16* out, int64_t ldo, bool prefetch) {
  switch (rows) {
#define PAGEDLLM_ROWS_CASE(R) \
  case R:                     \
    return micro_kernel<R, T>(x, k, packed, b, n, bias, out, ldo, prefetch);
    PAGEDLLM_ROWS_CASE(1) PAGEDLLM_ROWS_CASE(2) PAGEDLLM_ROWS_CASE(3) PAGEDLLM_ROWS_CASE(4)
    PAGEDLLM_ROWS_CASE(5) PAGEDLLM_ROWS_CASE(6) PAGEDLLM_ROWS_CASE(7) PAGEDLLM_ROWS_CASE(8)
#undef PAGEDLLM_ROWS_CASE
    default:
      TORCH_CHECK(false, "rows_kernel: bad row count ", rows);
  }
}

}  // namespace
#endif

// x [M, K] bfloat16 (contiguous), packed from pack_bf16_weight(w [N, K]), bias [N] float32 or
// None -> y [M, N] bfloat16 = x w^T (+ bias), see the header.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.dtype() == at::kBFloat16,
              "x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  check_packed(packed, n, k);
  at::Tensor bias_kept;
  const float* bptr = pagedllm_linear::bias_pointer(bias, n, bias_kept);
  auto y = cpu_tensor::empty({m, n}, x.scalar_type());
#if PAGEDLLM_BF16_GEMM
  const int64_t blocks = packed.size(0), pairs = (blocks + kT - 1) / kT;
  const int groups = static_cast<int>((m + kMaxRows - 1) / kMaxRows);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // Each thread takes a contiguous range of block pairs (one stream through the packed weight).
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = kT * p;
      const bool two = b + kT <= blocks;
      int64_t row = 0;
      for (int g = 0; g < groups; ++g) {   // near-equal row groups of <= kMaxRows
        const int rows = static_cast<int>((m - row) / (groups - g));
        if (two) {
          rows_kernel<kT>(rows, xp + row * k, k, wp, b, n, bptr, yp + row * n, n, g == 0);
        } else {
          rows_kernel<1>(rows, xp + row * k, k, wp, b, n, bptr, yp + row * n, n, false);  // the last, odd block
        }
        row += rows;
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX-512 BF16");
#endif
  return y;
}

// The code paths compiled in (load_extension's contract).
std::vector<std::string> compiled_isas() {
#if PAGEDLLM_BF16_GEMM
  return {"avx512_bf16"};
#else
  return {};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16_weight", &pack_bf16_weight, "w [N, K] bf16 -> packed [N/16, K/2, 32] bf16");
  m.def("bf16_linear", &bf16_linear, "x [M, K] bf16 @ packed^T (+ bias) -> [M, N] bf16");
  m.def("compiled_isas", &compiled_isas, "code paths compiled in");
}
