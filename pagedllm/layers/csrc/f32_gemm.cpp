// float32 GEMM for the linear layers of a float32 model on CPUs with AVX-512 or AVX2 + FMA.
//
//   y[m, n] = fl32( sum_k x[m, k] * w[n, k] ) (+ bias[n]),   x, w, y float32
//
// Why: a decode step's few rows are bound by reading the weights once, and oneDNN's packed float32
// inner product reads them at well under the memory's rate at 1-16 rows (docs/benchmarks.md,
// "float32 GEMM"); this kernel keeps a tile of rows x 32 outputs in vector accumulators and streams
// each weight tile once per row group, prefetching 4 KiB ahead, so the weights stream near the
// memory's rate. At prompt sizes the same loop is bound by the FMA units.
//
// Arithmetic: each output is one chain of fused multiply-adds in k order, starting from +0:
// acc = fma(x[m, k], w[n, k], acc) for k = 0, 1, ..., K - 1, then acc + bias[n] (one rounding) when a
// bias is given. The AVX-512 and the AVX2 code run the same chain per output lane (vfmadd231ps),
// so they give the same bits; the row groups, output tiles and threads only decide *which* outputs
// a call computes, never the order of a sum, so a row's result does not depend on the other rows
// of the batch nor on the thread count (batch-invariant by construction). Denormals are what the
// caller's MXCSR says (torch leaves them on unless set_flush_denormal).
//
// Packed layout (pack_f32_weight): outputs in blocks of 16 (zero rows pad the last block), each
// block contiguous over K as [K][16 outputs]: one 64-byte load is one column of 16 outputs, the
// outputs in the lanes, so a block's result is 16 adjacent outputs (no horizontal sums). Threads
// (at::parallel_for) split tiles of T blocks; a micro-kernel call holds up to MaxR rows x T blocks
// in accumulators, and the row groups of one tile follow each other (the tile is still in L2 for
// the second).

#include <torch/extension.h>

#include "linear_bias.h"

#include <ATen/Parallel.h>

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

namespace {

constexpr int64_t kBlock = 16;   // outputs per packed block (one zmm, or two ymm)
constexpr int64_t kPrefetchColumns = 64;  // software prefetch distance: 64 columns x 64 bytes = 4 KiB

}  // namespace

// w [N, K] float32 -> [ceil(N / 16), K, 16] float32 (the header's layout; zero outputs pad).
torch::Tensor pack_f32_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat32, "w must be a float32 [N, K] tensor");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({blocks * kBlock, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({blocks, kBlock, k}).transpose(1, 2).contiguous();
}

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

// All rows x all blocks with T-block x MaxR-row tiles. Each thread takes a contiguous range of
// tiles (one stream through the packed weight); a tile's row groups follow each other.
template <int T, int MaxR>
void run_tiles(int64_t m, int64_t k, int64_t blocks, const float* xp, const float* wp, int64_t n, const float* bptr,
               float* yp) {
  const int64_t tiles = (blocks + T - 1) / T;
  const int groups = static_cast<int>((m + MaxR - 1) / MaxR);
  at::parallel_for(0, tiles, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = T * p;
      int64_t row = 0;
      for (int g = 0; g < groups; ++g) {   // near-equal row groups of <= MaxR
        const int rows = static_cast<int>((m - row) / (groups - g));
        if (b + T <= blocks) {
          rows_kernel<T, MaxR>(rows, xp + row * k, k, wp, b, n, bptr, yp + row * n, n, g == 0);
        } else {
          for (int64_t bb = b; bb < blocks; ++bb)   // the last, partial tile: one block at a time
            rows_kernel<1, MaxR>(rows, xp + row * k, k, wp, bb, n, bptr, yp + row * n, n, false);
        }
        row += rows;
      }
    }
  });
}

}  // namespace
#endif

// x [M, K] float32 (contiguous), packed from pack_f32_weight(w [N, K]), bias [N] float32 or None
// -> y [M, N] float32 = x w^T (+ bias), see the header.
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.dtype() == torch::kFloat32,
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.dtype() == torch::kFloat32 && packed.is_contiguous() &&
                  packed.size(0) == (n + kBlock - 1) / kBlock && packed.size(1) == k && packed.size(2) == kBlock,
              "packed must come from pack_f32_weight of a [", n, ", ", k, "] weight");
  torch::Tensor bias_kept;
  const float* bptr = pagedllm_linear::bias_pointer(bias, n, bias_kept);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
#if PAGEDLLM_F32_GEMM
  const int64_t blocks = packed.size(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (m >= kLargeFromRows)
    run_tiles<kLargeT, kLargeRows>(m, k, blocks, xp, wp, n, bptr, yp);
  else
    run_tiles<kSmallT, kSmallRows>(m, k, blocks, xp, wp, n, bptr, yp);
#else
  TORCH_CHECK(false, "f32_linear: built without AVX-512 or AVX2 + FMA");
#endif
  return y;
}

// The code paths compiled in (load_extension's contract).
std::vector<std::string> compiled_isas() {
#if PAGEDLLM_F32_GEMM
  return {PAGEDLLM_F32_GEMM_ISA};
#else
  return {};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_f32_weight", &pack_f32_weight, "w [N, K] float32 -> packed [ceil(N/16), K, 16] float32");
  m.def("f32_linear", &f32_linear, "x [M, K] float32 @ packed^T (+ bias) -> [M, N] float32");
  m.def("compiled_isas", &compiled_isas, "code paths compiled in");
}
