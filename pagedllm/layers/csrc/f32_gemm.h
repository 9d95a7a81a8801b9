// The float32 GEMM's packed layout and micro-kernels (see f32_gemm.cpp's header for the layout
// and the arithmetic: one FMA chain per output in k order, so a row's result never depends on the
// other rows). Shared by f32_gemm.cpp (dense layers) and f32_moe.cpp (all experts of a MoE layer
// in one call). Everything is in an anonymous namespace: each extension compiles its own copy.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_F32_GEMM 1
#define PAGEDLLM_F32_GEMM_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_F32_GEMM 1
#define PAGEDLLM_F32_GEMM_ISA "avx2"
#else
#define PAGEDLLM_F32_GEMM 0
#endif

// The code paths compiled in (load_extension's contract).
inline std::vector<std::string> compiled_isas() {
#if PAGEDLLM_F32_GEMM
  return {PAGEDLLM_F32_GEMM_ISA};
#else
  return {};
#endif
}

namespace {

constexpr int64_t kBlock = 16;   // outputs per packed block (one zmm, or two ymm)
constexpr int64_t kPrefetchColumns = 64;  // software prefetch distance: 64 columns x 64 bytes = 4 KiB

}  // namespace

#if PAGEDLLM_F32_GEMM
namespace {

#if defined(__AVX512F__)
// Tiles (blocks x rows per micro-kernel call; accumulators = blocks x rows of the 32 zmm): a decode
// step's few rows as 2 x 12 (one pass over the weight for up to 12 rows), prompt chunks as 4 x 6
// (fewer broadcasts per FMA). Measured per M in docs/benchmarks.md, "float32 GEMM".
constexpr int kSmallT = 2, kSmallRows = 12;
constexpr int kLargeT = 4, kLargeRows = 6;
constexpr int64_t kLargeFromRows = 24;   // M at which the 4 x 6 tile takes over

struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 fma16(float x, V16 w, V16 acc) { return {_mm512_fmadd_ps(_mm512_set1_ps(x), w.v, acc.v)}; }
inline void store16(float* out, V16 acc, const float* bias, int64_t valid) {
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  __m512 v = acc.v;
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(out, mask, v);
}
#else
// One tile at every M: 1 block (two ymm) x 6 rows = 12 of the 16 ymm registers as accumulators.
constexpr int kSmallT = 1, kSmallRows = 6;
constexpr int kLargeT = 1, kLargeRows = 6;
constexpr int64_t kLargeFromRows = 0;

struct V16 {
  __m256 lo, hi;
};
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 fma16(float x, V16 w, V16 acc) {
  const __m256 xv = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(xv, w.lo, acc.lo), _mm256_fmadd_ps(xv, w.hi, acc.hi)};
}
inline void store16(float* out, V16 acc, const float* bias, int64_t valid) {
  alignas(32) float tmp[16];
  _mm256_store_ps(tmp, acc.lo);
  _mm256_store_ps(tmp + 8, acc.hi);
  for (int64_t i = 0; i < valid; ++i) out[i] = bias ? tmp[i] + bias[i] : tmp[i];
}
#endif

// R rows (x rows, row stride k) x T blocks starting at block b -> out rows, columns b * 16 ..
// (b + T) * 16 (stores stop at n).
template <int R, int T>
void micro_kernel(const float* x, int64_t k, const float* packed, int64_t b, int64_t n, const float* bias,
                  float* out, int64_t ldo, bool prefetch) {
  const float* wb[T];
  for (int t = 0; t < T; ++t) wb[t] = packed + (b + t) * k * kBlock;
  V16 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = zero16();
  for (int64_t c = 0; c < k; ++c) {
    // Each block's line kPrefetchColumns columns ahead into L2 (the first row group only: the
    // tile is in L2 for the others). Measured (docs/benchmarks.md, "float32 GEMM"): 4 KiB ahead
    // into L2 beat no prefetch and prefetching the next tile into L1.
    if (prefetch)
      for (int t = 0; t < T; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(wb[t] + (c + kPrefetchColumns) * kBlock), _MM_HINT_T1);
    V16 wv[T];
    for (int t = 0; t < T; ++t) wv[t] = load16(wb[t] + c * kBlock);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * k + c];
      for (int t = 0; t < T; ++t) acc[r][t] = fma16(xv, wv[t], acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t n0 = (b + t) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, n - n0);
    if (valid <= 0) continue;
    for (int r = 0; r < R; ++r) store16(out + r * ldo + n0, acc[r][t], bias ? bias + n0 : nullptr, valid);
  }
}

template <int T, int MaxR>
void rows_kernel(int rows, const float* x, int64_t k, const float* packed, int64_t b, int64_t n, const float* bias,
                 float* out, int64_t ldo, bool prefetch) {
  switch (rows) {
#define PAGEDLLM_ROWS_CASE(R) \
  case R:                     \
    return micro_kernel<(R <= MaxR ? R : 1), T>(x, k, packed, b, n, bias, out, ldo, prefetch);
    PAGEDLLM_ROWS_CASE(1) PAGEDLLM_ROWS_CASE(2) PAGEDLLM_ROWS_CASE(3) PAGEDLLM_ROWS_CASE(4)
    PAGEDLLM_ROWS_CASE(5) PAGEDLLM_ROWS_CASE(6) PAGEDLLM_ROWS_CASE(7) PAGEDLLM_ROWS_CASE(8)
    PAGEDLLM_ROWS_CASE(9) PAGEDLLM_ROWS_CASE(10) PAGEDLLM_ROWS_CASE(11) PAGEDLLM_ROWS_CASE(12)
#undef PAGEDLLM_ROWS_CASE
    default:
      TORCH_CHECK(false, "rows_kernel: bad row count ", rows);
  }
}

// One tile (T blocks from block b; one block at a time for the last, partial tile) for all m rows
// (x rows, row stride k), in near-equal row groups of <= MaxR that follow each other (the tile is
// still in L2 for the second): out [m, ldo], columns b * 16 .. (b + T) * 16 (stores stop at n).
template <int T, int MaxR>
void run_tile(int64_t m, const float* x, int64_t k, const float* packed, int64_t b, int64_t blocks, int64_t n,
              const float* bias, float* out, int64_t ldo) {
  const int groups = static_cast<int>((m + MaxR - 1) / MaxR);
  int64_t row = 0;
  for (int g = 0; g < groups; ++g) {
    const int rows = static_cast<int>((m - row) / (groups - g));
    if (b + T <= blocks) {
      rows_kernel<T, MaxR>(rows, x + row * k, k, packed, b, n, bias, out + row * ldo, ldo, g == 0);
    } else {
      for (int64_t bb = b; bb < blocks; ++bb)
        rows_kernel<1, MaxR>(rows, x + row * k, k, packed, bb, n, bias, out + row * ldo, ldo, false);
    }
    row += rows;
  }
}

}  // namespace
#endif  // PAGEDLLM_F32_GEMM
