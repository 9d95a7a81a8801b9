// bfloat16 GEMM on CPUs with AVX2 + FMA and no bf16 dot-product instruction (no avx512_bf16 / AMX).
//
//   y[m, n] = bf16( sum_k x[m, k] * w[n, k]  (+ bias[n]) ),   x, w bfloat16, sums in float32
//
// Why: at a decode step's few rows the linear layers and the LM head are bound by reading their
// weights once. bfloat16 weights are half the bytes of float32 ones, so streaming them and
// widening each to float32 in registers (a 16-bit shift or a mask: bf16 is the top half of a
// float32) does a step's weight traffic in about half the float32 GEMM's time; oneDNN's bf16 inner
// product has no AVX2 kernel (torch's bf16 matmul is several times slower than float32 there).
//
// Arithmetic: the AVX-512 BF16 GEMM's (bf16_gemm.cpp), step for step. vdpbf16ps does, per float32
// lane i and column pair (2c, 2c + 1) (Intel SDM, VDPBF16PS):
//     acc += x[2c + 1] * w[2c + 1];  acc += x[2c] * w[2c]
// with each product of two bfloat16 values exact in float32, so each step is one rounding: exactly
// a fused multiply-add. This code runs the same two _mm256_fmadd_ps per pair, c = 0, 1, ..., K/2 - 1,
// from +0, then adds the bias (+0 without one, as the AVX-512 code does) and rounds to bfloat16 to
// nearest even (a NaN becomes the quiet NaN (bits >> 16) | 0x40, as vcvtneps2bf16 gives), so for
// inputs and sums in float32's normal range it gives the AVX-512 kernel's bits. It differs where
// values are subnormal: vdpbf16ps and vcvtneps2bf16 treat subnormal inputs as zero and flush
// subnormal results, this code keeps them (MXCSR's defaults, as torch leaves them). Each output is
// one chain in k order whatever the row count, row groups, tiles or threads (they only decide
// *which* outputs a call computes), so a row's result does not depend on the other rows of the
// batch (batch-invariant by construction).
//
// Packed layout: bf16_pack.h's (pack_bf16_weight), the AVX-512 and AMX GEMMs' own: outputs in
// blocks of 16, each block [K / 2][16 outputs][2 columns] bfloat16. One 32-byte load is 8 outputs
// x 2 columns; the odd columns are the loaded lanes with the low 16 bits masked off, the even ones
// the lanes shifted left by 16: float32 with the outputs in the lanes, no shuffles.
// x is widened to float32 once per call ([M, K] float32, exact) and broadcast per column.
// Threads (at::parallel_for) split tiles of T blocks; a micro-kernel call holds up to MaxR rows x T
// blocks x 2 ymm accumulators, and the row groups of one tile follow each other (the tile is still
// in L2 for the second). One code for every M (never a second kernel by row count).

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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_BF16_AVX2 1
#else
#define PAGEDLLM_BF16_AVX2 0
#endif

namespace {

using pagedllm_bf16::check_packed;
using pagedllm_bf16::kBlock;
using pagedllm_bf16::kPair;
using pagedllm_bf16::pack_bf16_weight;
// Tiles (blocks x rows per micro-kernel call; 2 ymm accumulators per block and row, of 16 ymm):
// a decode step's rows as 2 blocks x 3 rows (four independent accumulator chains at one row),
// prompt chunks as 1 block x 5 rows (10 accumulators, the mask, two weight vectors and one
// broadcast x fit the 16 registers: no spills).
constexpr int kSmallT = 2, kSmallRows = 3;
constexpr int kLargeT = 1, kLargeRows = 5;
constexpr int64_t kLargeFromRows = 4;    // M at which the 1 x 5 tile takes over
constexpr int64_t kPrefetchBytes = 4096;  // software prefetch distance into L2

}  // namespace

#if PAGEDLLM_BF16_AVX2
namespace {

// 8 float32 -> 8 bfloat16 in the low 16 bits of each 32-bit lane: round to nearest even; a NaN
// keeps its top bits with the quiet bit set (vcvtneps2bf16's results for normal values and NaN).
inline __m256i round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(bits, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(top, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// Every loop over rows, blocks and halves of the micro-kernel unrolled before GCC's scalar
// replacement, so that the accumulators live in registers only.
#define PAGEDLLM_UNROLL _Pragma("GCC unroll 16")

// 16 accumulators (outputs n0 .. n0 + 15) + bias -> out[0 .. valid) bfloat16.
inline void store_bf16(c10::BFloat16* out, __m256 lo, __m256 hi, const float* bias, int64_t valid) {
  alignas(32) float b[16] = {};   // +0 without a bias (the AVX-512 code adds its zeroed bias vector)
  if (bias) std::memcpy(b, bias, valid * sizeof(float));
  lo = _mm256_add_ps(lo, _mm256_load_ps(b));
  hi = _mm256_add_ps(hi, _mm256_load_ps(b + 8));
  // packus works per 128-bit lane: [lo0-3 hi0-3 | lo4-7 hi4-7] -> reorder the 64-bit quarters
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_to_bf16(lo), round_to_bf16(hi)),
                                                  _MM_SHUFFLE(3, 1, 2, 0));
  if (valid == kBlock) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  } else {
    alignas(32) uint16_t tmp[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), packed);
    std::memcpy(out, tmp, valid * sizeof(uint16_t));
  }
}

// R rows (x float32, row stride k) x T blocks starting at block b -> out rows, columns b * 16 ..
// (b + T) * 16 (stores stop at n).
template <int R, int T>
void micro_kernel(const float* x, int64_t k, const c10::BFloat16* packed, int64_t b, int64_t n, const float* bias,
                  c10::BFloat16* out, int64_t ldo, bool prefetch) {
  const int64_t k2 = k / kPair;
  const __m256i* wb[T];
  PAGEDLLM_UNROLL
  for (int t = 0; t < T; ++t)
    wb[t] = reinterpret_cast<const __m256i*>(packed + (b + t) * k2 * kPair * kBlock);
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][T][2];
  PAGEDLLM_UNROLL
  for (int r = 0; r < R; ++r)
    PAGEDLLM_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  // Each block's line 4 KiB ahead into L2 (the first row group only: the tile is in L2 for the
  // others; they prefetch the line they read), as the AVX-512 and float32 GEMMs do.
  const int64_t ahead = prefetch ? kPrefetchBytes : 0;
  for (int64_t c = 0; c < k2; ++c) {
    PAGEDLLM_UNROLL
    for (int t = 0; t < T; ++t)
      _mm_prefetch(reinterpret_cast<const char*>(wb[t] + 2 * c) + ahead, _MM_HINT_T1);
    __m256i raw[T][2];
    __m256 w[T][2];
    PAGEDLLM_UNROLL
    for (int t = 0; t < T; ++t)
      PAGEDLLM_UNROLL
      for (int h = 0; h < 2; ++h) {
        raw[t][h] = _mm256_loadu_si256(wb[t] + 2 * c + h);
        w[t][h] = _mm256_castsi256_ps(_mm256_and_si256(raw[t][h], odd_mask));   // column 2c + 1
      }
    PAGEDLLM_UNROLL
    for (int r = 0; r < R; ++r) {   // acc += x[2c + 1] * w[2c + 1] (vdpbf16ps's first step)
      const __m256 xv = _mm256_broadcast_ss(x + r * k + kPair * c + 1);
      PAGEDLLM_UNROLL
      for (int t = 0; t < T; ++t)
        PAGEDLLM_UNROLL
        for (int h = 0; h < 2; ++h) acc[r][t][h] = _mm256_fmadd_ps(xv, w[t][h], acc[r][t][h]);
    }
    PAGEDLLM_UNROLL
    for (int t = 0; t < T; ++t)
      PAGEDLLM_UNROLL
      for (int h = 0; h < 2; ++h) w[t][h] = _mm256_castsi256_ps(_mm256_slli_epi32(raw[t][h], 16));   // column 2c
    PAGEDLLM_UNROLL
    for (int r = 0; r < R; ++r) {   // acc += x[2c] * w[2c] (its second)
      const __m256 xv = _mm256_broadcast_ss(x + r * k + kPair * c);
      PAGEDLLM_UNROLL
      for (int t = 0; t < T; ++t)
        PAGEDLLM_UNROLL
        for (int h = 0; h < 2; ++h) acc[r][t][h] = _mm256_fmadd_ps(xv, w[t][h], acc[r][t][h]);
    }
  }
  PAGEDLLM_UNROLL
  for (int t = 0; t < T; ++t) {
    const int64_t n0 = (b + t) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, n - n0);
    if (valid <= 0) continue;
    PAGEDLLM_UNROLL
    for (int r = 0; r < R; ++r)
      store_bf16(out + r * ldo + n0, acc[r][t][0], acc[r][t][1], bias ? bias + n0 : nullptr, valid);
  }
}

template <int T, int MaxR>
void rows_kernel(int rows, const float* x, int64_t k, const c10::BFloat16* packed, int64_t b, int64_t n,
                 const float* bias, c10::BFloat16* out, int64_t ldo, bool prefetch) {
  switch (rows) {
#define PAGEDLLM_ROWS_CASE(R) \
  case R:                     \
    return micro_kernel<(R <= MaxR ? R : 1), T>(x, k, packed, b, n, bias, out, ldo, prefetch);
    PAGEDLLM_ROWS_CASE(1) PAGEDLLM_ROWS_CASE(2) PAGEDLLM_ROWS_CASE(3)
    PAGEDLLM_ROWS_CASE(4) PAGEDLLM_ROWS_CASE(5) PAGEDLLM_ROWS_CASE(6)
#undef PAGEDLLM_ROWS_CASE
    default:
      TORCH_CHECK(false, "rows_kernel: bad row count ", rows);
  }
}

// All m rows x all blocks in tiles of T blocks (one block at a time for the last, partial tile),
// each tile's rows in near-equal groups of <= MaxR. Each thread takes a contiguous range of tiles
// (one stream through the packed weight).
template <int T, int MaxR>
void run_tiles(int64_t m, int64_t k, int64_t blocks, const float* xp, const c10::BFloat16* wp, int64_t n,
               const float* bptr, c10::BFloat16* yp) {
  const int64_t tiles = (blocks + T - 1) / T;
  const int groups = static_cast<int>((m + MaxR - 1) / MaxR);
  at::parallel_for(0, tiles, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = T * p;
      int64_t row = 0;
      for (int g = 0; g < groups; ++g) {
        const int rows = static_cast<int>((m - row) / (groups - g));
        if (b + T <= blocks) {
          rows_kernel<T, MaxR>(rows, xp + row * k, k, wp, b, n, bptr, yp + row * n, n, g == 0);
        } else {
          for (int64_t bb = b; bb < blocks; ++bb)
            rows_kernel<1, MaxR>(rows, xp + row * k, k, wp, bb, n, bptr, yp + row * n, n, false);
        }
        row += rows;
      }
    }
  });
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
  if (m == 0) return y;
#if PAGEDLLM_BF16_AVX2
  const at::Tensor xf = x.to(at::kFloat);   // exact
  const int64_t blocks = packed.size(0);
  const float* xp = xf.data_ptr<float>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  if (m >= kLargeFromRows)
    run_tiles<kLargeT, kLargeRows>(m, k, blocks, xp, wp, n, bptr, yp);
  else
    run_tiles<kSmallT, kSmallRows>(m, k, blocks, xp, wp, n, bptr, yp);
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX2 + FMA");
#endif
  return y;
}

// The code paths compiled in (load_extension's contract).
std::vector<std::string> compiled_isas() {
#if PAGEDLLM_BF16_AVX2
  return {"avx2_bf16"};
#else
  return {};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16_weight", &pack_bf16_weight, "w [N, K] bf16 -> packed [N/16, K/2, 32] bf16");
  m.def("bf16_linear", &bf16_linear, "x [M, K] bf16 @ packed^T (+ bias) -> [M, N] bf16");
  m.def("compiled_isas", &compiled_isas, "code paths compiled in");
}
