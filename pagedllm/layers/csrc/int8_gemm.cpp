// int8 weight-only GEMM for CPUs with AVX-512 VNNI (vpdpbusd); on AVX2 CPUs without VNNI, its
// int8_weight_only_mm with the same arithmetic through vpmaddwd (see "The AVX2 path" below).
//
//   y[m, n] = s[n] * sum_k q[n, k] * x[m, k] (+ bias[n]),   q int8 in [-127, 127], s float32
//
// Why: at small batches a step is bound by reading the weights, and widening int8 weights to
// floats costs more instructions than the memory takes to deliver them (torch's
// _weight_int8pack_mm and a vdpbf16ps kernel both reach ~30 GB/s on a 2-core Zen 4 whose plain
// read loop streams ~58 GB/s: docs/performance.md, session 8). Here the weights are never
// widened: the activation row is written in 16-bit fixed point and the products are summed in
// exact integer arithmetic by vpdpbusd (u8 x s8, four products per 32-bit lane).
//
// The activation row, per row m (all integer steps exact):
//   f_m = 32767 / max_k |x[m, k]| (1 for an all-zero row),  X[m, k] = round(x[m, k] * f_m) (to
//   nearest even; |X| <= 32767), U = X + 32768 in [1, 65535] split into bytes d0 = U mod 256,
//   d1 = U div 256 (so X = 256 (d1 - 128) + d0).
// For each output n the kernel sums A0 = sum_k d0 q and A1 = sum_k d1 q in int32 (|A| <= 255 * 127
// * K: no overflow for K <= 65536) and
//   sum_k X q = 256 * (A1 - 128 * R[n]) + A0,   R[n] = sum_k q[n, k] (precomputed at pack time),
// formed in float32 by one fused multiply-add (exact while |A1 - 128 R| < 2^24, i.e. K <= 1032;
// one float32 rounding above), then y = that * (s[n] * (1 / f_m)) + bias[n] in float32 and
// written in x's dtype. The only approximation before the final float32 steps is X's rounding:
// at most max|x[m]| / 65534 per element (bfloat16 rounding of the row, what torch's kernel does
// first, errs up to |x| / 512 per element). A row's result does not depend on the other rows.
//
// Packed layout (pack_int8_weight): output rows in blocks of 16 (zero rows pad the last block),
// each block contiguous over K as [K / 4][16 rows][4 columns] int8: one 64-byte load is 16 rows x
// 4 columns, vpdpbusd's operand layout with the rows in the lanes, so a block's result is 16
// adjacent outputs (no horizontal sums). Threads (at::parallel_for) split the blocks; a
// micro-kernel call holds up to kMaxRows rows x 2 digit sums of one block in zmm registers and
// streams the block once per kMaxRows rows.

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PAGEDLLM_INT8_VNNI 1
#define PAGEDLLM_INT8_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_INT8_VNNI 0
#define PAGEDLLM_INT8_AVX2 1
#else
#define PAGEDLLM_INT8_VNNI 0
#define PAGEDLLM_INT8_AVX2 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>  // the bf16-logit head's candidate search (bf16_logit_candidates)
#endif

#ifndef PAGEDLLM_INT8_PREFETCH
#define PAGEDLLM_INT8_PREFETCH 4096  // bytes ahead in each weight block's stream (into L2)
#endif
#ifndef PAGEDLLM_INT8_PREFETCH_ROWS
// Row blocks below this many rows prefetch nothing: the hardware prefetchers kept up there and the
// software prefetch only cost (LM head 262,144 x 640 at 1-4 rows: 1.2-1.4x faster without; from 6
// rows 4 KiB ahead into L2 was fastest: docs/benchmarks.md, "float32 GEMM").
#define PAGEDLLM_INT8_PREFETCH_ROWS 6
#endif

namespace {

constexpr int64_t kBlock = 16;     // output rows per packed block (zmm int32 lanes)
constexpr int64_t kGroup = 4;      // columns per vpdpbusd lane
#ifndef PAGEDLLM_INT8_ROWS
#define PAGEDLLM_INT8_ROWS 12
#endif
static_assert(PAGEDLLM_INT8_ROWS <= 12, "the micro-kernel names 12 accumulator pairs");
constexpr int kMaxRows = PAGEDLLM_INT8_ROWS;  // activation rows per micro-kernel call (x 2 digit sums)
constexpr int64_t kMaxK = 65536;   // int32 digit sums cannot overflow up to here

void check_packed(const at::Tensor& packed, const at::Tensor& row_sums, const at::Tensor& scales,
                  int64_t n, int64_t k) {
  TORCH_CHECK(packed.dtype() == at::kChar && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kGroup * kBlock,
              "packed must be a contiguous int8 [N / 16, K / 4, 64] tensor from pack_int8_weight");
  TORCH_CHECK(packed.size(1) * kGroup == k, "packed does not match K=", k);
  TORCH_CHECK(packed.size(0) * kBlock >= n && packed.size(0) * kBlock < n + kBlock, "packed does not match N=", n);
  TORCH_CHECK(row_sums.dtype() == at::kInt && row_sums.is_contiguous() &&
                  row_sums.numel() == packed.size(0) * kBlock,
              "row_sums must be the int32 tensor pack_int8_weight returned");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              "scales must be a contiguous float32 [N] tensor");
}

// x: a contiguous float32 or bfloat16 [M, K] row block for the packed weight (K a multiple of 16).
void check_input(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& row_sums,
                 const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.dtype() == at::kFloat || x.dtype() == at::kBFloat16, "x must be float32 or bfloat16");
  check_packed(packed, row_sums, scales, n, x.size(1));
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16, got ", x.size(1));
}

}  // namespace

// q [N, K] int8 (K a multiple of 4, <= 65536) -> (packed [ceil(N / 16), K / 4, 64] int8 in the layout
// above, row sums [ceil(N / 16) * 16] int32).
std::tuple<at::Tensor, at::Tensor> pack_int8_weight(const at::Tensor& q) {
  TORCH_CHECK(q.dtype() == at::kChar && q.dim() == 2, "q must be an int8 [N, K] tensor");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(k % kGroup == 0 && k <= kMaxK, "K must be a multiple of 4 and at most 65536, got ", k);
  const int64_t blocks = (n + kBlock - 1) / kBlock, k4 = k / kGroup;
  auto qc = q.contiguous();
  auto packed = cpu_tensor::zeros({blocks, k4, kGroup * kBlock}, q.scalar_type());
  auto row_sums = cpu_tensor::zeros({blocks * kBlock}, at::kInt);
  const int8_t* src = qc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sums = row_sums.data_ptr<int32_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < kBlock && b * kBlock + r < n; ++r) {
        const int8_t* row = src + (b * kBlock + r) * k;
        int8_t* out = dst + b * k4 * kGroup * kBlock + kGroup * r;
        int32_t sum = 0;
        for (int64_t c = 0; c < k4; ++c) {
          for (int64_t e = 0; e < kGroup; ++e) {
            out[c * kGroup * kBlock + e] = row[kGroup * c + e];
            sum += row[kGroup * c + e];
          }
        }
        sums[b * kBlock + r] = sum;
      }
    }
  });
  return {packed, row_sums};
}

namespace {

// float32 -> the smallest bfloat16 value >= v (as float32), for finite v >= 0.
float round_up_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  uint32_t b = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;  // to nearest even
  float r;
  std::memcpy(&r, &b, sizeof r);
  if (r < v) {
    b += 0x10000u;
    std::memcpy(&r, &b, sizeof r);
  }
  return r;
}

template <typename WT>
void quantize_rows(const WT* w, int64_t n, int64_t k, int8_t* q, float* scales, double* err, double* amax) {
  at::parallel_for(0, n, 256, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(k);
    for (int64_t r = r0; r < r1; ++r) {
      float m = 0.f;
      for (int64_t i = 0; i < k; ++i) {
        row[i] = static_cast<float>(w[r * k + i]);
        m = std::max(m, std::fabs(row[i]));
      }
      float s = round_up_to_bf16(m / 127.0f);
      if (!(s > 0.f)) s = 1.f;
      double e = 0.0, a = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const float code = std::min(127.f, std::max(-127.f, std::nearbyint(row[i] / s)));
        q[r * k + i] = static_cast<int8_t>(code);
        const float approx = code * s;  // exact: 8 x 8 significant bits
        e = std::max(e, std::fabs(static_cast<double>(approx) - static_cast<double>(row[i])));
        a = std::max(a, static_cast<double>(std::fabs(approx)));
      }
      scales[r] = s;
      err[r] = e;
      amax[r] = a;
    }
  });
}

}  // namespace

// w [N, K] float32 or bfloat16 -> (q [N, K] int8, s [N] float32, E [N] float64, A [N] float64):
// per row s = the smallest bfloat16 value >= max_i |w_i| / 127 (1 for a zero row), q_i =
// round(w_i / s) to nearest even, clamped to [-127, 127], E = max_i |q_i s - w_i|, A = max_i |q_i s|
// (each q_i s is exact in float32). The same numbers as sample/greedy_head.py's torch code, in one
// pass per row (that code allocates several float32 copies of the whole head).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_int8_rows(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.dtype() == at::kFloat || w.dtype() == at::kBFloat16),
              "w must be a float32 or bfloat16 [N, K] tensor");
  auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1);
  auto q = cpu_tensor::empty({n, k}, at::kChar);
  auto scales = cpu_tensor::empty({n}, at::kFloat);
  auto err = cpu_tensor::empty({n}, at::kDouble);
  auto amax = cpu_tensor::empty({n}, at::kDouble);
  if (wc.dtype() == at::kFloat) {
    quantize_rows(wc.data_ptr<float>(), n, k, q.data_ptr<int8_t>(), scales.data_ptr<float>(), err.data_ptr<double>(),
                  amax.data_ptr<double>());
  } else {
    quantize_rows(wc.data_ptr<c10::BFloat16>(), n, k, q.data_ptr<int8_t>(), scales.data_ptr<float>(),
                  err.data_ptr<double>(), amax.data_ptr<double>());
  }
  return {q, scales, err, amax};
}

// packed -> [N, K] int8: the codes back in row-major order (for tests and dequantized references).
at::Tensor unpack_int8_weight(const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.dtype() == at::kChar && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kGroup * kBlock && packed.size(0) * kBlock >= n,
              "packed must come from pack_int8_weight");
  const int64_t k4 = packed.size(1), k = k4 * kGroup;
  auto q = cpu_tensor::empty({n, k}, packed.scalar_type());
  const int8_t* src = packed.data_ptr<int8_t>();
  int8_t* dst = q.data_ptr<int8_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* block = src + (r / kBlock) * k4 * kGroup * kBlock + kGroup * (r % kBlock);
    for (int64_t c = 0; c < k4; ++c)
      for (int64_t e = 0; e < kGroup; ++e) dst[r * k + kGroup * c + e] = block[c * kGroup * kBlock + e];
  }
  return q;
}

#if PAGEDLLM_INT8_VNNI
namespace {

// Row m of x (float32 or bfloat16) -> digit bytes d0, d1 [K] and 1 / f_m (see the header).
template <typename InT>
float row_digits(const InT* x, int64_t k, uint8_t* d0, uint8_t* d1) {
  auto load = [&](int64_t i) -> __m512 {
    if constexpr (std::is_same_v<InT, float>) {
      return _mm512_loadu_ps(x + i);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  };
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load(i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  const float f = amax > 0.f ? 32767.f / amax : 1.f;
  const __m512 vf = _mm512_set1_ps(f);
  const __m512i lim = _mm512_set1_epi32(32767), offset = _mm512_set1_epi32(32768), low = _mm512_set1_epi32(255);
  for (int64_t i = 0; i < k; i += 16) {
    __m512i xq = _mm512_cvtps_epi32(_mm512_mul_ps(load(i), vf));  // round to nearest even (MXCSR default)
    xq = _mm512_max_epi32(_mm512_min_epi32(xq, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
    const __m512i u = _mm512_add_epi32(xq, offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d0 + i), _mm512_cvtepi32_epi8(_mm512_and_si512(u, low)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d1 + i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
  }
  return amax > 0.f ? amax / 32767.f : 1.f;
}

template <typename OutT>
inline void store_row(OutT* out, __m512 v, __mmask16 mask) {
  if constexpr (std::is_same_v<OutT, float>) {
    _mm512_mask_storeu_ps(out, mask, v);
  } else {  // bfloat16, round to nearest even (NaN kept quiet), as c10::BFloat16
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(r));
  }
}

// MB rows x the block at w -> out[:, n0 : n0 + 16]. digits: this row block's [K / 4][MB][2] dwords
// (d0 then d1 of 4 columns), so one pointer and constant offsets address every broadcast.
// The float32 result of row m for outputs n0 .. n0 + 15 (lanes past n masked off) goes to
// epilogue(m, v, mask).
template <int MB, typename Epilogue>
void micro_kernel(const uint32_t* digits, const float* inv_f, int64_t k4, const int8_t* w, const int32_t* row_sums,
                  int64_t n0, int64_t n, const float* scales, const float* bias, Epilogue&& epilogue) {
  // Named accumulators (GCC 12 keeps an array of them on the stack inside the loop).
#define PAGEDLLM_ACC(i) __m512i a0_##i = _mm512_setzero_si512(), a1_##i = _mm512_setzero_si512();
  PAGEDLLM_ACC(0) PAGEDLLM_ACC(1) PAGEDLLM_ACC(2) PAGEDLLM_ACC(3) PAGEDLLM_ACC(4) PAGEDLLM_ACC(5)
  PAGEDLLM_ACC(6) PAGEDLLM_ACC(7) PAGEDLLM_ACC(8) PAGEDLLM_ACC(9) PAGEDLLM_ACC(10) PAGEDLLM_ACC(11)
#undef PAGEDLLM_ACC
  for (int64_t c = 0; c < k4; ++c) {
    const int8_t* p = w + c * kGroup * kBlock;
#if PAGEDLLM_INT8_PREFETCH
    if constexpr (MB >= PAGEDLLM_INT8_PREFETCH_ROWS)
      _mm_prefetch(reinterpret_cast<const char*>(p + PAGEDLLM_INT8_PREFETCH), _MM_HINT_T1);
#endif
    const __m512i wv = _mm512_loadu_si512(p);
    const uint32_t* dc = digits + c * 2 * MB;
#define PAGEDLLM_DOT(i)                                                                     \
    if constexpr (i < MB) {                                                                 \
      a0_##i = _mm512_dpbusd_epi32(a0_##i, _mm512_set1_epi32(static_cast<int>(dc[2 * i])), wv);     \
      a1_##i = _mm512_dpbusd_epi32(a1_##i, _mm512_set1_epi32(static_cast<int>(dc[2 * i + 1])), wv); \
    }
    PAGEDLLM_DOT(0) PAGEDLLM_DOT(1) PAGEDLLM_DOT(2) PAGEDLLM_DOT(3) PAGEDLLM_DOT(4) PAGEDLLM_DOT(5)
    PAGEDLLM_DOT(6) PAGEDLLM_DOT(7) PAGEDLLM_DOT(8) PAGEDLLM_DOT(9) PAGEDLLM_DOT(10) PAGEDLLM_DOT(11)
#undef PAGEDLLM_DOT
  }
  const __m512i a0[12] = {a0_0, a0_1, a0_2, a0_3, a0_4, a0_5, a0_6, a0_7, a0_8, a0_9, a0_10, a0_11};
  const __m512i a1[12] = {a1_0, a1_1, a1_2, a1_3, a1_4, a1_5, a1_6, a1_7, a1_8, a1_9, a1_10, a1_11};
  const int64_t valid = std::min<int64_t>(kBlock, n - n0);
  const __mmask16 mask = valid >= kBlock ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 s = _mm512_maskz_loadu_ps(mask, scales + n0);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  const __m512i r128 = _mm512_slli_epi32(_mm512_loadu_si512(row_sums + n0), 7);
  for (int m = 0; m < MB; ++m) {
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(a1[m], r128));
    const __m512 dot = _mm512_fmadd_ps(hi, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(a0[m]));
    epilogue(m, _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(inv_f[m])), b), mask);
  }
}

// Every row of the call x the block at w: row blocks of kMaxRows, then the rest; epilogue(m, v, mask)
// with m the row's index in the call.
template <typename Epilogue>
void block_rows(const uint32_t* digits, const float* inv_f, int64_t rows, int64_t k4, const int8_t* w,
                const int32_t* row_sums, int64_t n0, int64_t n, const float* scales, const float* bias,
                Epilogue&& epilogue) {
  int64_t m = 0;
  for (; m + kMaxRows <= rows; m += kMaxRows) {
    const int64_t o = m;
    micro_kernel<kMaxRows>(digits + m * k4 * 2, inv_f + m, k4, w, row_sums, n0, n, scales, bias,
                           [&](int r, __m512 v, __mmask16 mask) { epilogue(o + r, v, mask); });
  }
  const int64_t o = m;
  auto shifted = [&](int r, __m512 v, __mmask16 mask) { epilogue(o + r, v, mask); };
  switch (rows - m) {
#define PAGEDLLM_TAIL(R)                                                                               \
  case R:                                                                                              \
    micro_kernel<R>(digits + o * k4 * 2, inv_f + o, k4, w, row_sums, n0, n, scales, bias, shifted); \
    break;
    PAGEDLLM_TAIL(1) PAGEDLLM_TAIL(2) PAGEDLLM_TAIL(3) PAGEDLLM_TAIL(4) PAGEDLLM_TAIL(5) PAGEDLLM_TAIL(6)
    PAGEDLLM_TAIL(7) PAGEDLLM_TAIL(8) PAGEDLLM_TAIL(9) PAGEDLLM_TAIL(10) PAGEDLLM_TAIL(11)
#undef PAGEDLLM_TAIL
    default: break;
  }
}

// The rows' digits: ``blocked`` per row block of kMaxRows rows (the last one shorter) as [K / 4][rows in
// block][2] dwords (block_rows' operand); ``single`` (if not null) each row alone as [K / 4][2] (a
// one-row micro-kernel's operand). Returns 1 / f per row.
template <typename InT>
std::vector<float> activation_digits(const InT* x, int64_t rows, int64_t k, std::vector<uint32_t>& blocked,
                                     std::vector<uint32_t>* single) {
  const int64_t k4 = k / kGroup;
  blocked.assign(rows * k4 * 2, 0);
  if (single) single->assign(rows * k4 * 2, 0);
  std::vector<float> inv_f(rows);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> d0(k4), d1(k4);
    for (int64_t r = r0; r < r1; ++r) {
      inv_f[r] = row_digits(x + r * k, k, reinterpret_cast<uint8_t*>(d0.data()), reinterpret_cast<uint8_t*>(d1.data()));
      const int64_t first = r - r % kMaxRows, in_block = std::min<int64_t>(kMaxRows, rows - first), i = r - first;
      uint32_t* dst = blocked.data() + first * k4 * 2;
      for (int64_t c = 0; c < k4; ++c) {
        dst[(c * in_block + i) * 2] = d0[c];
        dst[(c * in_block + i) * 2 + 1] = d1[c];
      }
      if (single) {
        uint32_t* one = single->data() + r * k4 * 2;
        for (int64_t c = 0; c < k4; ++c) {
          one[2 * c] = d0[c];
          one[2 * c + 1] = d1[c];
        }
      }
    }
  });
  return inv_f;
}

// Output blocks per parallel task: at least ~64 KiB of weights streamed per row block (a small layer at
// a decode step stays on one thread when splitting it costs more than it saves).
inline int64_t block_grain(int64_t rows, int64_t block_bytes) {
  const int64_t row_blocks = (rows + kMaxRows - 1) / kMaxRows;
  return std::max<int64_t>(1, 65536 / block_bytes / row_blocks);
}

template <typename InT, typename OutT>
void gemm(const InT* x, int64_t rows, int64_t k, const int8_t* packed, const int32_t* row_sums, int64_t n,
          const float* scales, const float* bias, OutT* out) {
  const int64_t k4 = k / kGroup;
  std::vector<uint32_t> digits;
  const std::vector<float> inv_f = activation_digits(x, rows, k, digits, nullptr);
  const int64_t blocks = (n + kBlock - 1) / kBlock, block_bytes = k4 * kGroup * kBlock;
  at::parallel_for(0, blocks, block_grain(rows, block_bytes), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      block_rows(digits.data(), inv_f.data(), rows, k4, packed + b * block_bytes, row_sums, n0, n, scales, bias,
                 [&](int64_t m, __m512 v, __mmask16 mask) { store_row(out + m * n + n0, v, mask); });
    }
  });
}

// float32 or bfloat16 (as uint16_t bits) -> double, exact.
inline double to_double(float v) { return v; }
inline double to_double(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Eight weights from w -> float64 lanes, exact.
inline __m512d load8_f64(const float* w) { return _mm512_cvtps_pd(_mm256_loadu_ps(w)); }
inline __m512d load8_f64(const uint16_t* w) {
  const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16);
  return _mm512_cvtps_pd(_mm256_castsi256_ps(b));
}

// sum_i x_i w_i and sum_i |x_i w_i| in float64, x already widened to float64 (K a multiple of 8).
// Every product is exact (<= 48 significant bits), so each lane's fused multiply-add rounds once
// and the sums err by at most gamma_K(2^-53) sum_i |x_i w_i| in any order (Higham 2002, eq. 3.4).
template <typename WT>
std::pair<double, double> dot_f64(const double* x, const WT* w, int64_t k) {
  __m512d s = _mm512_setzero_pd(), a = _mm512_setzero_pd();
  for (int64_t i = 0; i < k; i += 8) {
    const __m512d p = _mm512_mul_pd(_mm512_loadu_pd(x + i), load8_f64(w + i));
    s = _mm512_add_pd(s, p);
    a = _mm512_add_pd(a, _mm512_abs_pd(p));
  }
  return {_mm512_reduce_add_pd(s), _mm512_reduce_add_pd(a)};
}

// See int8_greedy_argmax below.
template <typename XT, typename WT>
void greedy_argmax(const XT* x, int64_t rows, int64_t k, const int8_t* packed, const int32_t* row_sums, int64_t n,
                   const float* scales, const WT* weight, const float* err2, const float* amax2, const float* row_n1,
                   const float* row_term, int64_t max_candidates, double g64, int64_t* tokens, int8_t* status,
                   int32_t* num_candidates) {
  const int64_t k4 = k / kGroup;
  std::vector<uint32_t> digits, single;
  const std::vector<float> inv_f = activation_digits(x, rows, k, digits, &single);
  const int64_t blocks = (n + kBlock - 1) / kBlock, block_bytes = k4 * kGroup * kBlock;
  // Pass 1: per row and block of 16 tokens, the largest c_j + B_j and the largest c_j - B_j.
  std::vector<float> plus(rows * blocks), minus(rows * blocks);
  auto bound = [&](int64_t m, int64_t n0, __mmask16 mask) {
    const __m512 e = _mm512_maskz_loadu_ps(mask, err2 + n0), a = _mm512_maskz_loadu_ps(mask, amax2 + n0);
    return _mm512_fmadd_ps(_mm512_set1_ps(row_n1[m]), e, _mm512_mul_ps(_mm512_set1_ps(row_term[m]), a));
  };
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  at::parallel_for(0, blocks, block_grain(rows, block_bytes), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      block_rows(digits.data(), inv_f.data(), rows, k4, packed + b * block_bytes, row_sums, n0, n, scales, nullptr,
                 [&](int64_t m, __m512 v, __mmask16 mask) {
                   const __m512 bj = bound(m, n0, mask);
                   plus[m * blocks + b] = _mm512_reduce_max_ps(_mm512_mask_add_ps(neg_inf, mask, v, bj));
                   minus[m * blocks + b] = _mm512_reduce_max_ps(_mm512_mask_sub_ps(neg_inf, mask, v, bj));
                 });
    }
  });
  // Pass 2, per row: the candidates {j : c_j + B_j >= L}, L = max_k (c_k - B_k), from the blocks that
  // reach L (their 16 scores computed again, by the same one-row arithmetic), re-scored in float64.
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> cands;
    std::vector<double> xd(k);
    alignas(64) float c16[kBlock];
    for (int64_t m = r0; m < r1; ++m) {
      const float* pm = plus.data() + m * blocks;
      const float low = *std::max_element(minus.data() + m * blocks, minus.data() + (m + 1) * blocks);
      cands.clear();
      status[m] = 0;
      for (int64_t b = 0; b < blocks && status[m] == 0; ++b) {
        if (!(pm[b] >= low)) continue;
        const int64_t n0 = b * kBlock;
        micro_kernel<1>(single.data() + m * k4 * 2, inv_f.data() + m, k4, packed + b * block_bytes, row_sums, n0, n,
                        scales, nullptr, [&](int, __m512 v, __mmask16 mask) {
                          const __m512 cb = _mm512_add_ps(v, bound(m, n0, mask));
                          _mm512_store_ps(c16, _mm512_mask_mov_ps(neg_inf, mask, cb));
                        });
        for (int64_t j = 0; j < kBlock; ++j) {
          if (c16[j] >= low) cands.push_back(n0 + j);
        }
        if (static_cast<int64_t>(cands.size()) > max_candidates) status[m] = 1;
      }
      num_candidates[m] = static_cast<int32_t>(cands.size());
      tokens[m] = -1;
      if (status[m] != 0 || cands.empty()) {
        status[m] = 1;
        continue;
      }
      // Exact re-score: the best float64 score (lowest id among equals); a rival within both float64
      // error bounds leaves the row to the caller's exact comparison (status 2).
      double best = -INFINITY, best_err = 0.0;
      int64_t best_j = -1;
      std::vector<std::pair<double, double>> scored(cands.size());
      for (int64_t i = 0; i < k; ++i) xd[i] = to_double(x[m * k + i]);
      for (size_t q = 0; q < cands.size(); ++q) {
        auto [sc, ab] = dot_f64(xd.data(), weight + cands[q] * k, k);
        scored[q] = {sc, 2.0 * g64 * ab};
        if (sc > best) {
          best = sc;
          best_err = scored[q].second;
          best_j = cands[q];
        }
      }
      tokens[m] = best_j;
      for (size_t q = 0; q < cands.size(); ++q) {
        if (cands[q] != best_j && scored[q].first + scored[q].second >= best - best_err) {
          status[m] = 2;
          break;
        }
      }
    }
  });
}

}  // namespace
#endif  // PAGEDLLM_INT8_VNNI

#if PAGEDLLM_INT8_AVX2
// The AVX2 path (CPUs without VNNI): the same packed weight and the same 16-bit fixed-point row X
// (the same f, rounding and clamp), the products summed exactly by vpmaddwd (int16 pairs into
// int32) instead of vpdpbusd over two digit bytes. One 16-byte load is 4 output rows x 4 columns,
// widened to int16; a 32-bit lane then holds one output row and two of the 4 columns (X broadcast
// 64 bits at a time), so each output has two int32 lane sums A (columns 4c, 4c+1) and B (4c+2,
// 4c+3). A lane adds at most 2 * 32767 * 127 per 4 columns, so it sums at most kAvx2ChunkGroups
// groups (1,024 columns) before its value is rounded to float32 and added to a float32 partial;
// S = fl32(A) + fl32(B) for K <= 1024: three float32 roundings, at most 2.01 u 32767 sum_k |q| in
// all (the exact greedy head's bound allows 3 u 65790 sum_k |q| for this step: greedy_head.py).
// Then y = S * (s[n] * (1 / f_m)) + bias[n], the VNNI path's epilogue.
namespace {

constexpr int64_t kAvx2ChunkGroups = 256;  // groups of 4 columns per int32 lane sum (< 2^31)

// Row of x (float32 or bfloat16) -> X [K] int16 (K a multiple of 16); returns 1 / f.
template <typename InT>
float row_fixed_point(const InT* x, int64_t k, int16_t* xq) {
  auto load = [&](int64_t i) -> __m256 {
    if constexpr (std::is_same_v<InT, float>) {
      return _mm256_loadu_ps(x + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  };
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load(i), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = lanes[0];
  for (int i = 1; i < 8; ++i) amax = std::max(amax, lanes[i]);
  const float f = amax > 0.f ? 32767.f / amax : 1.f;
  const __m256 vf = _mm256_set1_ps(f);
  const __m256i lim = _mm256_set1_epi32(32767), neg_lim = _mm256_set1_epi32(-32767);
  for (int64_t i = 0; i < k; i += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load(i), vf));  // round to nearest even (MXCSR default)
    v = _mm256_max_epi32(_mm256_min_epi32(v, lim), neg_lim);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(v, v), 0x08);  // 8 x int16, in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm256_castsi256_si128(packed));
  }
  return amax > 0.f ? amax / 32767.f : 1.f;
}

inline __m256i broadcast4(const int16_t* xq) {
  int64_t bits;
  std::memcpy(&bits, xq, sizeof bits);
  return _mm256_set1_epi64x(bits);
}

// MB (1 or 2) rows of X (row stride k) x the block at w -> y [MB][16] float32 (the header's S and epilogue).
template <int MB>
void avx2_block(const int16_t* xq, int64_t k, const float* inv_f, const int8_t* w, int64_t n0, int64_t n,
                const float* scales, const float* bias, float* y) {
  const int64_t k4 = k / kGroup;
  __m256 part[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < 4; ++g) part[m][g] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < k4; c0 += kAvx2ChunkGroups) {
    const int64_t c1 = std::min(k4, c0 + kAvx2ChunkGroups);
    // Named accumulators (an array stays on the stack inside the loop with GCC 12).
    __m256i a0_0 = _mm256_setzero_si256(), a0_1 = a0_0, a0_2 = a0_0, a0_3 = a0_0;
    __m256i a1_0 = a0_0, a1_1 = a0_0, a1_2 = a0_0, a1_3 = a0_0;
    for (int64_t c = c0; c < c1; ++c) {
      const int8_t* p = w + c * kGroup * kBlock;
      const __m256i x0 = broadcast4(xq + kGroup * c);
      const __m256i x1 = MB > 1 ? broadcast4(xq + k + kGroup * c) : x0;
#define PAGEDLLM_MADD(g)                                                                                   \
      {                                                                                                    \
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g))); \
        a0_##g = _mm256_add_epi32(a0_##g, _mm256_madd_epi16(wv, x0));                                     \
        if constexpr (MB > 1) a1_##g = _mm256_add_epi32(a1_##g, _mm256_madd_epi16(wv, x1));               \
      }
      PAGEDLLM_MADD(0) PAGEDLLM_MADD(1) PAGEDLLM_MADD(2) PAGEDLLM_MADD(3)
#undef PAGEDLLM_MADD
    }
    part[0][0] = _mm256_add_ps(part[0][0], _mm256_cvtepi32_ps(a0_0));
    part[0][1] = _mm256_add_ps(part[0][1], _mm256_cvtepi32_ps(a0_1));
    part[0][2] = _mm256_add_ps(part[0][2], _mm256_cvtepi32_ps(a0_2));
    part[0][3] = _mm256_add_ps(part[0][3], _mm256_cvtepi32_ps(a0_3));
    if constexpr (MB > 1) {
      part[MB - 1][0] = _mm256_add_ps(part[MB - 1][0], _mm256_cvtepi32_ps(a1_0));
      part[MB - 1][1] = _mm256_add_ps(part[MB - 1][1], _mm256_cvtepi32_ps(a1_1));
      part[MB - 1][2] = _mm256_add_ps(part[MB - 1][2], _mm256_cvtepi32_ps(a1_2));
      part[MB - 1][3] = _mm256_add_ps(part[MB - 1][3], _mm256_cvtepi32_ps(a1_3));
    }
  }
  const int64_t valid = std::min<int64_t>(kBlock, n - n0);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane);
  const __m256i mask_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid) - 8), lane);
  const __m256 s_lo = _mm256_maskload_ps(scales + n0, mask_lo), s_hi = _mm256_maskload_ps(scales + n0 + 8, mask_hi);
  const __m256 b_lo = bias ? _mm256_maskload_ps(bias + n0, mask_lo) : _mm256_setzero_ps();
  const __m256 b_hi = bias ? _mm256_maskload_ps(bias + n0 + 8, mask_hi) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) {
    // part[m][g] lanes: rows 4g..4g+3 of the block, each as (A, B); hadd pairs them up as rows
    // (0, 1, 4, 5 | 2, 3, 6, 7) of the two groups, and the 64-bit permute puts them in order.
    const __m256 lo = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(part[m][0], part[m][1])), 0xD8));
    const __m256 hi = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(part[m][2], part[m][3])), 0xD8));
    const __m256 f = _mm256_set1_ps(inv_f[m]);
    _mm256_storeu_ps(y + 16 * m, _mm256_fmadd_ps(lo, _mm256_mul_ps(s_lo, f), b_lo));
    _mm256_storeu_ps(y + 16 * m + 8, _mm256_fmadd_ps(hi, _mm256_mul_ps(s_hi, f), b_hi));
  }
}

template <typename InT, typename OutT>
void gemm_avx2(const InT* x, int64_t rows, int64_t k, const int8_t* packed, int64_t n, const float* scales,
               const float* bias, OutT* out) {
  std::vector<int16_t> xq(rows * k);
  std::vector<float> inv_f(rows);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) inv_f[r] = row_fixed_point(x + r * k, k, xq.data() + r * k);
  });
  const int64_t blocks = (n + kBlock - 1) / kBlock, block_bytes = k * kBlock;
  // At least ~64 KiB of weights streamed per row pair in a task (as the VNNI path's block_grain).
  const int64_t grain = std::max<int64_t>(1, 65536 / block_bytes / ((rows + 1) / 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    alignas(32) float y[32];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, valid = std::min<int64_t>(kBlock, n - n0);
      const int8_t* wb = packed + b * block_bytes;
      for (int64_t m = 0; m < rows; m += 2) {
        const int mb = rows - m >= 2 ? 2 : 1;
        if (mb == 2) avx2_block<2>(xq.data() + m * k, k, inv_f.data() + m, wb, n0, n, scales, bias, y);
        else avx2_block<1>(xq.data() + m * k, k, inv_f.data() + m, wb, n0, n, scales, bias, y);
        for (int r = 0; r < mb; ++r) {
          OutT* dst = out + (m + r) * n + n0;
          if constexpr (std::is_same_v<OutT, float>) {
            std::memcpy(dst, y + 16 * r, valid * sizeof(float));
          } else {  // bfloat16, round to nearest even, as c10::BFloat16
            for (int64_t j = 0; j < valid; ++j) dst[j] = c10::BFloat16(y[16 * r + j]);
          }
        }
      }
    }
  });
}

}  // namespace
#endif  // PAGEDLLM_INT8_AVX2

// x [M, K] float32 or bfloat16 -> [M, N] in x's dtype (see the header for the arithmetic).
at::Tensor int8_weight_only_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& row_sums,
                                  const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n) {
#if PAGEDLLM_INT8_VNNI || PAGEDLLM_INT8_AVX2
  check_input(x, packed, row_sums, scales, n);
  const int64_t rows = x.size(0), k = x.size(1);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N] tensor");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = cpu_tensor::empty({rows, n}, x.scalar_type());
  if (rows == 0) return out;
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const uint16_t* xb = x.dtype() == at::kFloat ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
#if PAGEDLLM_INT8_VNNI
  const int32_t* sums = row_sums.data_ptr<int32_t>();
  if (!xb) {
    gemm<float, float>(x.data_ptr<float>(), rows, k, w, sums, n, s, bias_ptr, out.data_ptr<float>());
  } else {
    gemm<uint16_t, uint16_t>(xb, rows, k, w, sums, n, s, bias_ptr, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
  }
#else
  if (!xb) {
    gemm_avx2<float, float>(x.data_ptr<float>(), rows, k, w, n, s, bias_ptr, out.data_ptr<float>());
  } else {
    gemm_avx2<uint16_t, c10::BFloat16>(xb, rows, k, w, n, s, bias_ptr, out.data_ptr<c10::BFloat16>());
  }
#endif
  return out;
#else
  TORCH_CHECK(false, "int8_weight_only_mm was not compiled in: this CPU lacks avx512_vnni and avx2");
  return x;
#endif
}

// The exact greedy head's int8 pass (sample/greedy_head.py, kind "int8_vnni"; the bound and its
// float32 evaluation are derived there): per row m of x [M, K] (float32 or bfloat16),
//   c_j = this kernel's score of token j, B_j = row_n1[m] * err2[j] + row_term[m] * amax2[j] (float32),
//   L = max_j (c_j - B_j), candidates {j : c_j + B_j >= L} (every exact maximum is one),
// each candidate re-scored in float64 against weight [N, K] (float32 or bfloat16, the head as stored).
// Returns (tokens [M] int64, status [M] int8, candidates [M] int32): status 0 = tokens[m] is the exact
// argmax; 1 = more than max_candidates candidates (tokens[m] = -1: the caller runs the full head);
// 2 = tokens[m] is the best float64 score but another candidate lies within both float64 error bounds
// (2 g64 sum |x_i w_i| each): the caller decides exactly.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_greedy_argmax(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& row_sums, const at::Tensor& scales,
    int64_t n, const at::Tensor& weight, const at::Tensor& err2, const at::Tensor& amax2,
    const at::Tensor& row_n1, const at::Tensor& row_term, int64_t max_candidates, double g64) {
#if PAGEDLLM_INT8_VNNI
  check_input(x, packed, row_sums, scales, n);
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == n && weight.size(1) == k &&
                  (weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16),
              "weight must be a contiguous float32 or bfloat16 [N, K] tensor");
  for (const auto* t : {&err2, &amax2})
    TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous() && t->numel() == n,
                "err2 and amax2 must be contiguous float32 [N] tensors");
  for (const auto* t : {&row_n1, &row_term})
    TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous() && t->numel() == rows,
                "row_n1 and row_term must be contiguous float32 [M] tensors");
  auto tokens = cpu_tensor::empty({rows}, at::kLong);
  auto status = cpu_tensor::empty({rows}, at::kChar);
  auto counts = cpu_tensor::empty({rows}, at::kInt);
  if (rows == 0) return {tokens, status, counts};
  auto run = [&](auto* xp, auto* wp) {
    greedy_argmax(xp, rows, k, packed.data_ptr<int8_t>(), row_sums.data_ptr<int32_t>(), n, scales.data_ptr<float>(),
                  wp, err2.data_ptr<float>(), amax2.data_ptr<float>(), row_n1.data_ptr<float>(),
                  row_term.data_ptr<float>(), max_candidates, g64, tokens.data_ptr<int64_t>(),
                  status.data_ptr<int8_t>(), counts.data_ptr<int32_t>());
  };
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); };
  const bool xf = x.dtype() == at::kFloat, wf = weight.dtype() == at::kFloat;
  if (xf && wf) run(x.data_ptr<float>(), weight.data_ptr<float>());
  else if (xf) run(x.data_ptr<float>(), bits(weight));
  else if (wf) run(bits(x), weight.data_ptr<float>());
  else run(bits(x), bits(weight));
  return {tokens, status, counts};
#else
  TORCH_CHECK(false, "int8_greedy_argmax was not compiled in: this CPU lacks avx512_vnni");
  return {x, x, x};
#endif
}

// The largest of row[0..n) and whether any is NaN.
inline void row_max(const float* row, int64_t n, float& best, bool& nan) {
  best = -std::numeric_limits<float>::infinity();
  nan = false;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vmax = _mm256_set1_ps(best), vnan = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(row + j);
    vmax = _mm256_max_ps(vmax, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float l : lanes) best = std::max(best, l);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; j < n; ++j) {
    best = std::max(best, row[j]);
    nan |= row[j] != row[j];
  }
}

// The bf16-logit head's candidate search (sample/greedy_head.py, ``_argmax_bf16_logits``; the window
// is derived there). Per row m of the cheap scores c [M, N] float32 (-inf: a token the row may not take),
// in float64 (the factor 2 in P covers its roundings, FMA contractions included):
//   P_j = 2 ((1 + u_o) (n1 E_j + A_j t + g n1 (A_j + E_j)) + tiny),  T_j = P_j + 2 u_o |c_j|,
//   top = the first maximum of c, low0 = c_top - T_top, candidates
//   {j : c_j + T_j >= low0 and c_j + T_j >= max_k over those (c_k - T_k)}
// (max_k (c_k - T_k) >= low0 over all tokens, and the top is one of them). The first test runs in
// float32 over every token, with E_j, A_j and the row constants rounded up (err_up, amax_up: [N]) and
// a slack of 16 2^-24 (3 |c_top| + 3 |low0| + 6 P_max + 1) under low0, more than its float32
// roundings can move c_j + T_j for any token near the threshold: it keeps a superset; the float64
// tests then decide. row_n1, row_term: [M] float64 (n1 = |x|_1, t = the fixed-point term); err, amax:
// [N] float64 (E_j, A_j). Returns (rows [Q] int64, tokens [Q] int64, cmax [M] float64: the row's max
// c, NaN when c has a NaN); a row whose cmax, n1 or t is not finite gets no candidates. Candidates
// come row by row, tokens ascending.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bf16_logit_candidates(
    const at::Tensor& c, const at::Tensor& row_n1, const at::Tensor& row_term, const at::Tensor& err,
    const at::Tensor& amax, const at::Tensor& err_up, const at::Tensor& amax_up, double err_max, double amax_max,
    double g, double u_o, double tiny) {
  TORCH_CHECK(c.dim() == 2 && c.dtype() == at::kFloat && c.is_contiguous(), "c must be a contiguous float32 [M, N] tensor");
  const int64_t rows = c.size(0), n = c.size(1);
  for (const auto* t : {&row_n1, &row_term})
    TORCH_CHECK(t->dtype() == at::kDouble && t->is_contiguous() && t->numel() == rows,
                "row_n1 and row_term must be contiguous float64 [M] tensors");
  for (const auto* t : {&err, &amax})
    TORCH_CHECK(t->dtype() == at::kDouble && t->is_contiguous() && t->numel() == n,
                "err and amax must be contiguous float64 [N] tensors");
  for (const auto* t : {&err_up, &amax_up})
    TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous() && t->numel() == n,
                "err_up and amax_up must be contiguous float32 [N] tensors");
  const float* cp = c.data_ptr<float>();
  const double *n1p = row_n1.data_ptr<double>(), *tp = row_term.data_ptr<double>();
  const double *ep = err.data_ptr<double>(), *ap = amax.data_ptr<double>();
  const float *euf = err_up.data_ptr<float>(), *auf = amax_up.data_ptr<float>();
  auto cmax_t = cpu_tensor::empty({rows}, at::kDouble);
  double* cmax_out = cmax_t.data_ptr<double>();
  std::vector<std::vector<int64_t>> found(rows);
  auto up = [](double v) {   // the smallest float32 >= v (finite v)
    float f = static_cast<float>(v);
    return static_cast<double>(f) < v ? std::nextafter(f, std::numeric_limits<float>::infinity()) : f;
  };
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      const float* row = cp + m * n;
      const double n1 = n1p[m], t = tp[m];
      // P_j = alpha E_j + beta A_j + kappa
      const double alpha = 2.0 * (1.0 + u_o) * (n1 + g * n1), beta = 2.0 * (1.0 + u_o) * (t + g * n1), kappa = 2.0 * tiny;
      auto p_of = [&](double e, double a) { return 2.0 * ((1.0 + u_o) * (n1 * e + a * t + g * n1 * (a + e)) + tiny); };
      float best;
      bool nan;
      row_max(row, n, best, nan);
      const double cmax = nan ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(best);
      cmax_out[m] = cmax;
      if (!std::isfinite(cmax) || !std::isfinite(n1) || !std::isfinite(t)) continue;
      int64_t top = 0;
      while (row[top] != best) ++top;   // the first maximum
      const double low0 = cmax - p_of(ep[top], ap[top]) - 2.0 * u_o * std::fabs(cmax);
      const double p_max = p_of(err_max, amax_max);
      const double slack = 16.0 * std::ldexp(1.0, -24) * (3.0 * std::fabs(cmax) + 3.0 * std::fabs(low0) + 6.0 * p_max + 1.0);
      const double thr = low0 - slack;
      float thr_f = static_cast<float>(thr);
      if (static_cast<double>(thr_f) > thr) thr_f = std::nextafter(thr_f, -std::numeric_limits<float>::infinity());
      const float two_u = static_cast<float>(2.0 * u_o);   // a power of two: exact
      const float alpha_f = up(alpha), beta_f = up(beta), kappa_f = up(kappa);
      std::vector<int64_t> near;
      std::vector<double> bound;
      double low = -std::numeric_limits<double>::infinity();
      auto take = [&](int64_t j) {   // the float64 tests
        const double v = row[j];
        const double b = p_of(ep[j], ap[j]) + 2.0 * u_o * std::fabs(v);
        if (v + b < low0) return;
        near.push_back(j);
        bound.push_back(b);
        low = std::max(low, v - b);
      };
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 vthr = _mm256_set1_ps(thr_f), vtwo_u = _mm256_set1_ps(two_u), valpha = _mm256_set1_ps(alpha_f);
      const __m256 vbeta = _mm256_set1_ps(beta_f), vkappa = _mm256_set1_ps(kappa_f);
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(row + j);
        __m256 f = _mm256_fmadd_ps(_mm256_and_ps(v, abs_mask), vtwo_u, v);
        f = _mm256_fmadd_ps(_mm256_loadu_ps(euf + j), valpha, f);
        f = _mm256_fmadd_ps(_mm256_loadu_ps(auf + j), vbeta, f);
        f = _mm256_add_ps(f, vkappa);
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(f, vthr, _CMP_GE_OQ));
        while (bits) {
          take(j + __builtin_ctz(bits));
          bits &= bits - 1;
        }
      }
#endif
      for (; j < n; ++j) {
        const float v = row[j];
        if (v + two_u * std::fabs(v) + alpha_f * euf[j] + beta_f * auf[j] + kappa_f >= thr_f) take(j);
      }
      for (size_t q = 0; q < near.size(); ++q)
        if (static_cast<double>(row[near[q]]) + bound[q] >= low) found[m].push_back(near[q]);
    }
  });
  int64_t total = 0;
  for (const auto& f : found) total += static_cast<int64_t>(f.size());
  auto rows_t = cpu_tensor::empty({total}, at::kLong);
  auto toks_t = cpu_tensor::empty({total}, at::kLong);
  int64_t* rp = rows_t.data_ptr<int64_t>();
  int64_t* kp = toks_t.data_ptr<int64_t>();
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j : found[m]) { *rp++ = m; *kp++ = j; }
  return {rows_t, toks_t, cmax_t};
}

std::vector<std::string> compiled_isas() {
#if PAGEDLLM_INT8_VNNI
  return {"avx512_vnni"};
#elif PAGEDLLM_INT8_AVX2
  return {"avx2"};
#else
  return {};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "int8 weight-only GEMM (AVX-512 VNNI or AVX2, activations in 16-bit fixed point per row)";
  m.def("pack_int8_weight", &pack_int8_weight, "q [N, K] int8 -> (packed [ceil(N/16), K/4, 64], row sums)",
        py::arg("q"));
  m.def("quantize_int8_rows", &quantize_int8_rows, "w [N, K] -> (q int8, scales, max |q s - w|, max |q s|) per row",
        py::arg("w"));
  m.def("unpack_int8_weight", &unpack_int8_weight, "packed -> q [N, K] int8", py::arg("packed"), py::arg("n"));
  m.def("int8_weight_only_mm", &int8_weight_only_mm, "s * (x @ q^T) + bias", py::arg("x"), py::arg("packed"),
        py::arg("row_sums"), py::arg("scales"), py::arg("bias"), py::arg("n"));
  m.def("int8_greedy_argmax", &int8_greedy_argmax,
        "exact greedy head, int8 pass: (tokens, status, candidates) per row (sample/greedy_head.py)", py::arg("x"),
        py::arg("packed"), py::arg("row_sums"), py::arg("scales"), py::arg("n"), py::arg("weight"), py::arg("err2"),
        py::arg("amax2"), py::arg("row_n1"), py::arg("row_term"), py::arg("max_candidates"), py::arg("g64"));
  m.def("bf16_logit_candidates", &bf16_logit_candidates,
        "the bf16-logit head's candidates: (rows, tokens, row maxima) (sample/greedy_head.py)", py::arg("c"),
        py::arg("row_n1"), py::arg("row_term"), py::arg("err"), py::arg("amax"), py::arg("err_up"),
        py::arg("amax_up"), py::arg("err_max"),
        py::arg("amax_max"), py::arg("g"), py::arg("u_o"), py::arg("tiny"));
  m.def("compiled_isas", &compiled_isas, "the code paths compiled in: avx512_vnni, avx2 (int8_weight_only_mm only), or none");
}
