// Paged attention for CPU that reads K/V in place through the block table.
//
// Source: PagedAttention (Kwon et al., SOSP 2023), V1 kernel layout (one work item per sequence and
// kv head, K/V rows addressed through the block table, no gather); online softmax with a running
// max and sum per query row (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022). Sliding
// window per Hugging Face / Mistral (the query at position p sees keys p - window < k <= p); soft cap
// per Gemma 2 (cap * tanh(s / cap)).
//
// Layout (see pagedllm/attention/backends/cpu_paged.py for the Python side):
//   query, out:       [num_tokens, num_heads, head_dim], float32 or bfloat16, last dim contiguous.
//   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype, contiguous.
//   block_tables:     [num_seqs, max_num_blocks] int32.
//   query_start_loc:  [num_seqs + 1] int32; seq_lens, context_lens: [num_seqs] int32.
//   seq_ids:          [n] int32, the sequences this call handles (the others' rows are untouched).
//   key, value, slot_mapping (optional): this step's K/V [num_tokens, num_kv_heads, head_dim]
//                     (head_dim contiguous) and int64 slots [num_tokens], written into the caches
//                     before attending (write_kv's index_copy_, without padding slots).
//
// Work item = (sequence, kv head, tile of up to kTileTokens query tokens). The G = num_heads /
// num_kv_heads query heads of a kv head are processed together (rows = tokens x G), so each K/V row
// loaded from the cache is used by every row of the tile (grouped-query attention). Keys are
// visited in chunks of kKeyChunk positions: scores of 4 rows x 2 keys per micro-kernel call
// (8 independent FMA chains, AVX2; AVX-512: 4 rows x 4 keys, 16 chains and one transposing
// reduction), then the online-softmax update per row (vector exp), then the chunk's V rows
// accumulated into float32 accumulators held in registers across the chunk. The K/V rows
// kPrefetchKeys keys ahead are software-prefetched while keys are scored, since consecutive blocks
// of a sequence lie anywhere in the pool (decode is bound by this memory traffic). bfloat16 is
// widened to float32 on load; all accumulation is float32.
// Items are handed out dynamically to the at::parallel_for threads (an atomic counter, longest
// first), since decode and prefill items differ in cost.
//
// Only positions [first key of the tile, last query position of the tile] are read, all of which
// the cache holds for this step, and a row's masked keys get probability exactly 0 without their
// score being used, so NaN in never-written (or masked) slots cannot leak into the output.
//
// Batch invariance: a query row's output is the same bits whichever tile, step or batch holds it
// (alone as a decode, inside any prefill chunk, beside any other sequences). Key chunks start at
// multiples of kKeyChunk for every tile; a row's own visible range picks its chunk's keys, its
// softmax steps and the vector-exp path; every score is one dot product summed in one order
// (dot_4x4's and dot_rows' reductions share reduce16's tree); keys a row cannot see add exactly 0
// to its accumulators. tests/attention/test_attention_batch_invariance.py checks it bit for bit.

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#else
#define PAGEDLLM_AVX2 0
#endif
#if PAGEDLLM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDLLM_AVX512 1
#else
#define PAGEDLLM_AVX512 0
#endif
#if PAGEDLLM_AVX512 && defined(__AVX512BF16__)
#define PAGEDLLM_AVX512_BF16 1
#else
#define PAGEDLLM_AVX512_BF16 0
#endif

#ifndef PAGEDLLM_PREFETCH
#define PAGEDLLM_PREFETCH 1  // software prefetch of the K/V rows kPrefetchKeys keys ahead
#endif

namespace {

// The code paths, chosen per call by the caller (pagedllm/platforms/cpu.py picks the best one the
// CPU's flags allow). Only paths the compiler was allowed to emit (-march=native) are compiled in.
enum Isa : int {
  kPortable = 0,    // plain C++ loops: the reference every other path is tested against
  kAvx2 = 1,        // 8-wide float32 FMA
  kAvx512 = 2,      // 16-wide float32 FMA (bfloat16 widened on load)
  kAvx512Bf16 = 3,  // as kAvx512, with q.k of bfloat16 caches by vdpbf16ps (float32 sums)
};

constexpr int64_t kTileTokens = 16;  // query tokens per work item (prefill chunks)
constexpr int64_t kKeyChunk = 32;    // key positions per online-softmax step
constexpr int kRowGroup = 4;         // query rows per micro-kernel call
// Software-prefetch distance in key rows (8, 16 and 32 measured alike on the decode benchmark,
// benchmarks/paged_attention_kernel.py) and the cache line size.
constexpr int64_t kPrefetchKeys = 16;
constexpr int64_t kCacheLine = 64;

// Software prefetch of one cache line (prefetch_line) or one cached K or V row (prefetch_row, bytes
// from p) into L1.
inline void prefetch_line(const void* p) {
#if PAGEDLLM_PREFETCH && defined(__x86_64__)
  // prefetcht0 by inline asm: GCC 12 dropped __builtin_prefetch in this kernel's loops (no prefetch
  // instruction in the binary; docs/performance.md step 22).
  asm volatile("prefetcht0 (%0)" : : "r"(p));
#elif PAGEDLLM_PREFETCH
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += kCacheLine) prefetch_line(static_cast<const char*>(p) + b);
}

// The K/V rows to prefetch while a chunk's keys are scored: k[j], v[j] (kPrefetchKeys keys past chunk
// key j) for j < n; rows [0, done) were asked for. A 4-key micro-kernel that takes rows [j, j + 4)
// spreads their lines over its loop; otherwise they are asked for whole, before their keys.
template <typename T>
struct ChunkPrefetch {
  const T* const* k = nullptr;
  const T* const* v = nullptr;
  int64_t n = 0, done = 0, bytes = 0;
  void upto(int64_t j) {
    for (; done < std::min(j, n); ++done) {
      prefetch_row(k[done], bytes);
      prefetch_row(v[done], bytes);
    }
  }
  bool take4(int64_t j) {
    upto(j);
    if (done != j || j + 4 > n) return false;
    done = j + 4;
    return true;
  }
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if PAGEDLLM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: zero-extend to 32 bits and shift left 16.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, Cody-Waite split of ln2, degree-5 polynomial;
// relative error ~1e-7). Inputs below -87 return ~exp(-87) = 1.6e-38 instead of smaller values,
// which is irrelevant next to the row maximum's exp(0) = 1.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#if PAGEDLLM_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The 16 horizontal sums of a[0..15] as one vector (lane i = sum of a[i]'s lanes): a transposing
// add tree of 45 shuffles and adds instead of 16 separate reductions (~144).
inline __m512 reduce16(const __m512* a) {
  __m512 u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i(0+2), a2i+1(0+2), a2i(1+3), a2i+1(1+3)]
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a4i, a4i+1, a4i+2, a4i+3] (partial sums)
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
    w[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes [w2i.0+w2i.1, w2i.2+w2i.3, w2i+1.0+w2i+1.1, ...]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
}

// One horizontal sum in reduce16's order (per 128-bit lane (e0 + e2) + (e1 + e3), then (L0 + L1) +
// (L2 + L3)), so that a score is the same bits whether a 4 x 4 call or dot_rows computed it: which
// kernel scores a key depends on the tile's rows and keys, and a row's result must not.
inline float reduce1(__m512 v) {
  __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));   // e0 + e2, e1 + e3 (twice)
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));           // (e0 + e2) + (e1 + e3) in every element
  const __m512 u = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xb1));  // L0 + L1, L2 + L3
  return _mm512_cvtss_f32(_mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0x4e)));
}

// Scores of 4 query rows (float32, row stride d) against 4 key rows: s[r * s_ld + k] = q[r] . key[k].
// 16 independent FMA chains; each loaded key vector serves 4 rows, each query vector 4 keys; one
// reduce16 for all 16 sums. d must be a multiple of 16.
// PF: also prefetch one line (the one at element i) of each of the 4 K and 4 V rows pk, pv per step.
template <bool PF, typename T>
inline void dot_4x4(const float* q, int64_t d, const T* const* keys, float* s, int64_t s_ld,
                    const T* const* pk, const T* const* pv) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    if constexpr (PF) {
      if (i * static_cast<int64_t>(sizeof(T)) % kCacheLine == 0)
        for (int m = 0; m < 4; ++m) prefetch_line(pk[m] + i), prefetch_line(pv[m] + i);
    }
    const __m512 k0 = load16(keys[0] + i), k1 = load16(keys[1] + i), k2 = load16(keys[2] + i),
                 k3 = load16(keys[3] + i);
    for (int r = 0; r < 4; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * d + i);
      a[4 * r] = _mm512_fmadd_ps(qv, k0, a[4 * r]);
      a[4 * r + 1] = _mm512_fmadd_ps(qv, k1, a[4 * r + 1]);
      a[4 * r + 2] = _mm512_fmadd_ps(qv, k2, a[4 * r + 2]);
      a[4 * r + 3] = _mm512_fmadd_ps(qv, k3, a[4 * r + 3]);
    }
  }
  const __m512 sums = reduce16(a);  // lane 4r + k
  for (int r = 0; r < 4; ++r) _mm_storeu_ps(s + r * s_ld, _mm512_extractf32x4_ps(sums, r));
}
#endif

// Scores of R query rows (float32, pre-scaled, row stride d) against NK (1 or 2) key rows:
// s[r * s_ld + k] = q[r] . key[k]. R * NK independent FMA chains hide the FMA latency, and each
// loaded key vector serves R rows, each loaded query vector NK keys.
template <int ISA, int R, int NK, typename T>
inline void dot_rows(const float* q, int64_t d, const T* const* keys, float* s, int64_t s_ld) {
  float acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NK; ++k) acc[r][k] = 0.f;
  int64_t i = 0;
#if PAGEDLLM_AVX512
  if constexpr (ISA >= kAvx512) {
    __m512 a[R][NK];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < NK; ++k) a[r][k] = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) {
      __m512 kv[NK];
      for (int k = 0; k < NK; ++k) kv[k] = load16(keys[k] + i);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_loadu_ps(q + r * d + i);
        for (int k = 0; k < NK; ++k) a[r][k] = _mm512_fmadd_ps(qv, kv[k], a[r][k]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < NK; ++k) acc[r][k] = reduce1(a[r][k]);
  }
#endif
#if PAGEDLLM_AVX2
  if constexpr (ISA == kAvx2) {
    __m256 a[R][NK];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < NK; ++k) a[r][k] = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) {
      __m256 kv[NK];
      for (int k = 0; k < NK; ++k) kv[k] = load8(keys[k] + i);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * d + i);
        for (int k = 0; k < NK; ++k) a[r][k] = _mm256_fmadd_ps(qv, kv[k], a[r][k]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < NK; ++k) acc[r][k] = hsum(a[r][k]);
  }
#endif
  for (; i < d; ++i) {
    for (int k = 0; k < NK; ++k) {
      const float kv = to_float(keys[k][i]);
      for (int r = 0; r < R; ++r) acc[r][k] += q[r * d + i] * kv;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NK; ++k) s[r * s_ld + k] = acc[r][k];
}

#if PAGEDLLM_AVX512_BF16
// As dot_rows for bfloat16 caches with bfloat16 query rows qb (unscaled: the model's own bf16
// values, so nothing is rounded that the model did not round): pairs of products summed into
// float32 lanes by vdpbf16ps (each product exact in float32), then multiplied by scale.
template <int R, int NK>
inline void dot_rows_bf16(const c10::BFloat16* qb, int64_t d, const c10::BFloat16* const* keys,
                          float scale, float* s, int64_t s_ld) {
  __m512 a[R][NK];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NK; ++k) a[r][k] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    __m512bh kv[NK];
    for (int k = 0; k < NK; ++k) kv[k] = (__m512bh)_mm512_loadu_si512(keys[k] + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + r * d + i);
      for (int k = 0; k < NK; ++k) a[r][k] = _mm512_dpbf16_ps(a[r][k], qv, kv[k]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < NK; ++k) {
      float acc = reduce1(a[r][k]);
      for (int64_t t = i; t < d; ++t) acc += to_float(qb[r * d + t]) * to_float(keys[k][t]);
      s[r * s_ld + k] = acc * scale;
    }
  }
}
#endif

#if PAGEDLLM_AVX512_BF16
// dot_4x4 for bfloat16 caches and unscaled bfloat16 query rows (vdpbf16ps pairs, float32 sums), times
// scale. d must be a multiple of 32.
template <bool PF>
inline void dot_4x4_bf16(const c10::BFloat16* qb, int64_t d, const c10::BFloat16* const* keys, float scale,
                         float* s, int64_t s_ld, const c10::BFloat16* const* pk, const c10::BFloat16* const* pv) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 32) {  // 64 bytes of each row per step
    if constexpr (PF)
      for (int m = 0; m < 4; ++m) prefetch_line(pk[m] + i), prefetch_line(pv[m] + i);
    __m512bh kv[4];
    for (int k = 0; k < 4; ++k) kv[k] = (__m512bh)_mm512_loadu_si512(keys[k] + i);
    for (int r = 0; r < 4; ++r) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + r * d + i);
      for (int k = 0; k < 4; ++k) a[4 * r + k] = _mm512_dpbf16_ps(a[4 * r + k], qv, kv[k]);
    }
  }
  const __m512 sums = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
  for (int r = 0; r < 4; ++r) _mm_storeu_ps(s + r * s_ld, _mm512_extractf32x4_ps(sums, r));
}
#endif

// acc[r] += sum_{j in [j0, j1)} p[r * p_ld + j] * v[j] for R rows (float32 accumulators, row
// stride d). d outer, keys inner: the accumulators stay in registers across the chunk's keys.
template <int ISA, int R, typename T>
inline void accumulate_rows(float* acc, int64_t d, const float* p, int64_t p_ld,
                            const T* const* v, int64_t j0, int64_t j1) {
  int64_t i = 0;
#if PAGEDLLM_AVX512
  if constexpr (ISA >= kAvx512) {
    // 64 columns x R rows of accumulators (16 registers at R = 4): one broadcast of p serves 4 FMAs.
    for (; i + 64 <= d; i += 64) {
      __m512 a[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(acc + r * d + i + 16 * c);
      for (int64_t j = j0; j < j1; ++j) {
        __m512 vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = load16(v[j] + i + 16 * c);
        for (int r = 0; r < R; ++r) {
          const __m512 pr = _mm512_set1_ps(p[r * p_ld + j]);
          for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(pr, vv[c], a[r][c]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * d + i + 16 * c, a[r][c]);
    }
    for (; i + 32 <= d; i += 32) {
      __m512 a0[R], a1[R];
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_loadu_ps(acc + r * d + i);
        a1[r] = _mm512_loadu_ps(acc + r * d + i + 16);
      }
      for (int64_t j = j0; j < j1; ++j) {
        const __m512 v0 = load16(v[j] + i), v1 = load16(v[j] + i + 16);
        for (int r = 0; r < R; ++r) {
          const __m512 pr = _mm512_set1_ps(p[r * p_ld + j]);
          a0[r] = _mm512_fmadd_ps(pr, v0, a0[r]);
          a1[r] = _mm512_fmadd_ps(pr, v1, a1[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(acc + r * d + i, a0[r]);
        _mm512_storeu_ps(acc + r * d + i + 16, a1[r]);
      }
    }
    for (; i + 16 <= d; i += 16) {
      __m512 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(acc + r * d + i);
      for (int64_t j = j0; j < j1; ++j) {
        const __m512 vv = load16(v[j] + i);
        for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * p_ld + j]), vv, a[r]);
      }
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * d + i, a[r]);
    }
  }
#endif
#if PAGEDLLM_AVX2
  if constexpr (ISA == kAvx2) {
    for (; i + 16 <= d; i += 16) {
      __m256 a0[R], a1[R];
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm256_loadu_ps(acc + r * d + i);
        a1[r] = _mm256_loadu_ps(acc + r * d + i + 8);
      }
      for (int64_t j = j0; j < j1; ++j) {
        const __m256 v0 = load8(v[j] + i), v1 = load8(v[j] + i + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 pr = _mm256_broadcast_ss(p + r * p_ld + j);
          a0[r] = _mm256_fmadd_ps(pr, v0, a0[r]);
          a1[r] = _mm256_fmadd_ps(pr, v1, a1[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(acc + r * d + i, a0[r]);
        _mm256_storeu_ps(acc + r * d + i + 8, a1[r]);
      }
    }
    for (; i + 8 <= d; i += 8) {
      __m256 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc + r * d + i);
      for (int64_t j = j0; j < j1; ++j) {
        const __m256 vv = load8(v[j] + i);
        for (int r = 0; r < R; ++r)
          a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * p_ld + j), vv, a[r]);
      }
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * d + i, a[r]);
    }
  }
#endif
  for (; i < d; ++i) {
    for (int64_t j = j0; j < j1; ++j) {
      const float vv = to_float(v[j][i]);
      for (int r = 0; r < R; ++r) acc[r * d + i] += p[r * p_ld + j] * vv;
    }
  }
}

// Scores of rows [r0, r0 + R) against keys [j0, j1) of the chunk, two keys at a time. qf holds the
// rows pre-scaled in float32; qb the same rows unscaled in T (read by the bf16 dot-product path).
// Scores of rows [r0, r0 + R) against keys [j0, j1) of the chunk, four (AVX-512, R = 4) or two keys at
// a time. qf holds the rows pre-scaled in float32; qb the same rows unscaled in T (read by the bf16
// dot-product path). pf (may be null): the rows to prefetch meanwhile.
template <int ISA, int R, typename T>
inline void score_group(const float* q, const T* qb, int64_t d, float scale, const T* const* k_rows,
                        int64_t j0, int64_t j1, float* s, ChunkPrefetch<T>* pf) {
  int64_t j = j0;
#if PAGEDLLM_AVX512_BF16
  if constexpr (ISA == kAvx512Bf16 && std::is_same_v<T, c10::BFloat16>) {
    if (R == 4 && d % 32 == 0) {
      for (; j + 4 <= j1; j += 4) {
        if (pf && pf->take4(j)) {
          dot_4x4_bf16<true>(qb, d, k_rows + j, scale, s + j, kKeyChunk, pf->k + j, pf->v + j);
        } else {
          if (pf) pf->upto(j + 4);
          dot_4x4_bf16<false>(qb, d, k_rows + j, scale, s + j, kKeyChunk, nullptr, nullptr);
        }
      }
    }
    for (; j + 2 <= j1; j += 2) {
      if (pf) pf->upto(j + 2);
      dot_rows_bf16<R, 2>(qb, d, k_rows + j, scale, s + j, kKeyChunk);
    }
    if (j < j1) {
      if (pf) pf->upto(j1);
      dot_rows_bf16<R, 1>(qb, d, k_rows + j, scale, s + j, kKeyChunk);
    }
    return;
  }
#endif
  (void)qb;
  (void)scale;
#if PAGEDLLM_AVX512
  if constexpr (ISA >= kAvx512 && R == 4) {
    if (d % 16 == 0) {
      for (; j + 4 <= j1; j += 4) {
        if (pf && pf->take4(j)) {
          dot_4x4<true>(q, d, k_rows + j, s + j, kKeyChunk, pf->k + j, pf->v + j);
        } else {
          if (pf) pf->upto(j + 4);
          dot_4x4<false>(q, d, k_rows + j, s + j, kKeyChunk, k_rows, k_rows);
        }
      }
    }
  }
#endif
  for (; j + 2 <= j1; j += 2) {
    if (pf) pf->upto(j + 2);
    dot_rows<ISA, R, 2>(q, d, k_rows + j, s + j, kKeyChunk);
  }
  if (j < j1) {
    if (pf) pf->upto(j1);
    dot_rows<ISA, R, 1>(q, d, k_rows + j, s + j, kKeyChunk);
  }
}

struct Item {
  int32_t seq;
  int32_t kv_head;
  int32_t tok_begin;  // flattened-batch token index
  int32_t tok_end;
  int64_t cost;  // query tokens x keys read, to schedule the longest items first
};

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  int64_t c_stride_block, c_stride_tok, c_stride_head;
  int64_t bt_stride;
  float scale, soft_cap;  // soft_cap <= 0: none
  int64_t window;         // <= 0: none
};

// Keys [*j0, *j1) of the chunk [c0, c0 + n) that a query at some position in [pos_a, pos_b] can
// see: p - window < k <= p.
inline void visible_range(const Geometry& g, int64_t pos_a, int64_t pos_b, int64_t c0, int64_t n,
                          int64_t* j0, int64_t* j1) {
  const int64_t lo = g.window > 0 ? std::max<int64_t>(0, pos_a - g.window + 1) : 0;
  *j0 = std::max<int64_t>(0, lo - c0);
  *j1 = std::min<int64_t>(n, pos_b - c0 + 1);
}

template <int ISA, typename T>
void run_item(const Item& it, const Geometry& g, const T* q_base, T* o_base, const T* k_base,
              const T* v_base, const int32_t* block_table, int64_t q_start, int64_t ctx_len,
              std::vector<float>& qf, std::vector<T>& qb, std::vector<float>& acc, std::vector<float>& scores,
              std::vector<float>& row_max, std::vector<float>& row_sum,
              std::vector<const T*>& k_ptrs, std::vector<const T*>& v_ptrs) {
  const int64_t d = g.head_dim;
  const int64_t num_tok = it.tok_end - it.tok_begin;
  const int64_t rows = num_tok * g.group;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Query rows (token-major, then the group's heads), widened and pre-scaled.
  for (int64_t t = 0; t < num_tok; ++t) {
    for (int64_t h = 0; h < g.group; ++h) {
      const T* src = q_base + (it.tok_begin + t) * g.q_stride_t +
                     (it.kv_head * g.group + h) * g.q_stride_h;
      float* dst = qf.data() + (t * g.group + h) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * g.scale;
      if constexpr (ISA == kAvx512Bf16) std::copy(src, src + d, qb.data() + (t * g.group + h) * d);
    }
  }
  std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
  std::fill(row_max.begin(), row_max.begin() + rows, neg_inf);
  std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);

  // Positions of the tile's first and last query tokens; the keys any row of the tile may see.
  const int64_t pos_first = ctx_len + (it.tok_begin - q_start);
  const int64_t pos_last = pos_first + num_tok - 1;
  // Chunks start at multiples of kKeyChunk (the tile's first visible key rounded down), so a row
  // meets the same chunks, hence the same online-softmax steps, in any tile: alone as a decode,
  // in any prefill chunk, beside any other rows. The keys before the first visible one are
  // addressed but never read (every row's visible range starts later).
  const int64_t key_lo = g.window > 0 ? std::max<int64_t>(0, pos_first - g.window + 1) / kKeyChunk * kKeyChunk : 0;
  const int64_t key_hi = pos_last;  // inclusive

  const int64_t head_off = it.kv_head * g.c_stride_head;
  // Row pointers of every key the tile reads, one block-table lookup per block touched.
  const int64_t num_keys = key_hi + 1 - key_lo;
  if (static_cast<int64_t>(k_ptrs.size()) < num_keys) {
    k_ptrs.resize(num_keys);
    v_ptrs.resize(num_keys);
  }
  for (int64_t j = 0; j < num_keys;) {
    const int64_t pos = key_lo + j;
    const int64_t off = pos % g.block_size;
    const int64_t base = static_cast<int64_t>(block_table[pos / g.block_size]) * g.c_stride_block + head_off;
    const int64_t m = std::min(num_keys - j, g.block_size - off);
    for (int64_t t = 0; t < m; ++t, ++j) {
      k_ptrs[j] = k_base + base + (off + t) * g.c_stride_tok;
      v_ptrs[j] = v_base + base + (off + t) * g.c_stride_tok;
    }
  }
  // Consecutive blocks of a sequence lie anywhere in the pool, where the hardware prefetcher cannot
  // follow: the K/V rows kPrefetchKeys keys ahead are software-prefetched, two keys per key pair
  // scored, so that the requests stay spread between the FMAs. The first kPrefetchKeys keys are
  // asked for up front.
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < std::min(num_keys, kPrefetchKeys); ++j) {
    prefetch_row(k_ptrs[j], row_bytes);
    prefetch_row(v_ptrs[j], row_bytes);
  }
  for (int64_t c0 = key_lo; c0 <= key_hi; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, key_hi + 1 - c0);
    const T* const* k_rows = k_ptrs.data() + (c0 - key_lo);
    const T* const* v_rows = v_ptrs.data() + (c0 - key_lo);
    // Rows kPrefetchKeys ahead of this chunk's keys, asked for while the first row group is scored
    // (and after it, those its range did not reach: it sees fewer keys on the diagonal).
    ChunkPrefetch<T> pf;
    pf.n = std::clamp<int64_t>(num_keys - (c0 - key_lo) - kPrefetchKeys, 0, n);
    if (pf.n > 0) {
      pf.k = k_rows + kPrefetchKeys;
      pf.v = v_rows + kPrefetchKeys;
    }
    pf.bytes = row_bytes;
    // Scores, kRowGroup rows at a time, over the keys some row of the group can see (rows of
    // a group are consecutive tokens' heads, so that range is [lo(first), last position]).
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      const int64_t nr = std::min<int64_t>(kRowGroup, rows - r0);
      int64_t j0, j1;
      visible_range(g, pos_first + r0 / g.group, pos_first + (r0 + nr - 1) / g.group, c0, n, &j0,
                    &j1);
      if (j0 >= j1) continue;
      const float* q = qf.data() + r0 * d;
      const T* q_raw = qb.data() + r0 * d;
      float* s = scores.data() + r0 * kKeyChunk;
      ChunkPrefetch<T>* p = r0 == 0 ? &pf : nullptr;
      switch (nr) {
        case 4: score_group<ISA, 4>(q, q_raw, d, g.scale, k_rows, j0, j1, s, p); break;
        case 3: score_group<ISA, 3>(q, q_raw, d, g.scale, k_rows, j0, j1, s, p); break;
        case 2: score_group<ISA, 2>(q, q_raw, d, g.scale, k_rows, j0, j1, s, p); break;
        default: score_group<ISA, 1>(q, q_raw, d, g.scale, k_rows, j0, j1, s, p); break;
      }
    }
    pf.upto(n);
    // Online softmax per row: probabilities of this chunk (exactly 0 where masked), running
    // max and sum, and the accumulator rescaled when the max grows.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = pos_first + r / g.group;
      int64_t j0, j1;
      visible_range(g, pos, pos, c0, n, &j0, &j1);
      float* s = scores.data() + r * kKeyChunk;
      if (j0 >= j1) {
        std::fill(s, s + kKeyChunk, 0.f);
        continue;
      }
      if (g.soft_cap > 0.f)
        for (int64_t j = j0; j < j1; ++j) s[j] = g.soft_cap * std::tanh(s[j] / g.soft_cap);
      float chunk_max = s[j0];
      for (int64_t j = j0 + 1; j < j1; ++j) chunk_max = std::max(chunk_max, s[j]);
      const float new_max = std::max(row_max[r], chunk_max);
      const float alpha = std::exp(row_max[r] - new_max);  // exp(-inf) = 0 on the first chunk
      float sum = 0.f;
      int64_t j = 0;
#if PAGEDLLM_AVX2
      if (ISA >= kAvx2 && j0 == 0 && j1 == kKeyChunk) {  // the common full chunk: vector exp
        const __m256 mx = _mm256_set1_ps(new_max);
        __m256 acc_sum = _mm256_setzero_ps();
        for (; j < kKeyChunk; j += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
          _mm256_storeu_ps(s + j, e);
          acc_sum = _mm256_add_ps(acc_sum, e);
        }
        sum = hsum(acc_sum);
      }
#endif
      if (j < kKeyChunk) {
        for (j = 0; j < j0; ++j) s[j] = 0.f;
        for (; j < j1; ++j) {
          s[j] = std::exp(s[j] - new_max);
          sum += s[j];
        }
        for (; j < kKeyChunk; ++j) s[j] = 0.f;
      }
      row_sum[r] = row_sum[r] * alpha + sum;
      row_max[r] = new_max;
      if (alpha != 1.f) {
        float* a = acc.data() + r * d;
        for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
      }
    }
    // Accumulate P @ V, kRowGroup rows at a time over the group's visible keys.
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      const int64_t nr = std::min<int64_t>(kRowGroup, rows - r0);
      int64_t j0, j1;
      visible_range(g, pos_first + r0 / g.group, pos_first + (r0 + nr - 1) / g.group, c0, n, &j0,
                    &j1);
      if (j0 >= j1) continue;
      float* a = acc.data() + r0 * d;
      const float* p = scores.data() + r0 * kKeyChunk;
      switch (nr) {
        case 4: accumulate_rows<ISA, 4>(a, d, p, kKeyChunk, v_rows, j0, j1); break;
        case 3: accumulate_rows<ISA, 3>(a, d, p, kKeyChunk, v_rows, j0, j1); break;
        case 2: accumulate_rows<ISA, 2>(a, d, p, kKeyChunk, v_rows, j0, j1); break;
        default: accumulate_rows<ISA, 1>(a, d, p, kKeyChunk, v_rows, j0, j1); break;
      }
    }
  }

  for (int64_t t = 0; t < num_tok; ++t) {
    for (int64_t h = 0; h < g.group; ++h) {
      const int64_t r = t * g.group + h;
      const float inv = 1.f / row_sum[r];  // >= 1 term: every query sees its own key
      T* dst = o_base + (it.tok_begin + t) * g.o_stride_t +
               (it.kv_head * g.group + h) * g.o_stride_h;
      const float* a = acc.data() + r * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(a[i] * inv);
    }
  }
}

template <int ISA, typename T>
void run(const at::Tensor& query, at::Tensor& out, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const int32_t* block_tables, const int32_t* q_starts,
         const int32_t* ctx_lens, const std::vector<Item>& items, const Geometry& g) {
  const T* q_base = query.data_ptr<T>();
  T* o_base = out.data_ptr<T>();
  const T* k_base = k_cache.data_ptr<T>();
  const T* v_base = v_cache.data_ptr<T>();
  // Work buffers sized for the largest tile of this call (a decode's tile is one token: G rows,
  // not kTileTokens x G; every item indexes them below its own rows only).
  int64_t max_tok = 1;
  for (const Item& it : items) max_tok = std::max<int64_t>(max_tok, it.tok_end - it.tok_begin);
  const int64_t max_rows = max_tok * g.group;
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      std::vector<float> qf(max_rows * g.head_dim), acc(max_rows * g.head_dim);
      std::vector<T> qb(ISA == kAvx512Bf16 ? max_rows * g.head_dim : 0);
      std::vector<float> scores(max_rows * kKeyChunk), row_max(max_rows), row_sum(max_rows);
      std::vector<const T*> k_ptrs, v_ptrs;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        const Item& it = items[i];
        run_item<ISA, T>(it, g, q_base, o_base, k_base, v_base, block_tables + it.seq * g.bt_stride,
                    q_starts[it.seq], ctx_lens[it.seq], qf, qb, acc, scores, row_max, row_sum, k_ptrs,
                    v_ptrs);
      }
    }
  });
}

bool isa_compiled(int isa) {
  switch (isa) {
    case kPortable: return true;
    case kAvx2: return PAGEDLLM_AVX2;
    case kAvx512: return PAGEDLLM_AVX512;
    case kAvx512Bf16: return PAGEDLLM_AVX512_BF16;
    default: return false;
  }
}

void check_int32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// Copies token t's K and V ([num_kv_heads, head_dim] rows of key / value, heads strided, head_dim
// contiguous) to cache slot slots[t] (= block * block_size + offset) of the contiguous caches,
// as write_kv's index_copy_ does (pagedllm/attention/ops.py); every slot must be in range.
void write_kv_slots(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), heads = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == heads && key.size(2) == d,
              "key and value must be [num_tokens, ", heads, ", ", d, "] to match the cache, got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
              "key/value dtype must be the caches' ", k_cache.scalar_type());
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu(), "key and value must be CPU tensors");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value must be contiguous in head_dim");
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens,
              "slot_mapping must be a contiguous int64 CPU tensor of ", tokens, " slots");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = d * static_cast<int64_t>(key.element_size());
  const int64_t slot_stride = heads * d;   // elements per slot (contiguous caches)
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t esz = key.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot_mapping[", t, "] = ", slot, " out of range [0, ",
                num_slots, ")");
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = (slot * slot_stride + h * d) * esz;
      std::memcpy(kc + dst, kp + (t * key.stride(0) + h * key.stride(1)) * esz, row_bytes);
      std::memcpy(vc + dst, vp + (t * value.stride(0) + h * value.stride(1)) * esz, row_bytes);
    }
  }
}

}  // namespace

// Writes the attention output of every query token of the sequences `seq_ids` into `out`. With
// key, value and slot_mapping, first writes this step's K/V into the caches (one call per layer
// instead of two index_copy_ and the kernel).
void paged_attention(const at::Tensor& query, at::Tensor& out, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& context_lens, const at::Tensor& seq_ids, double scale,
                     int64_t sliding_window, double logits_soft_cap, int64_t isa,
                     const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value,
                     const std::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query and out must be [num_tokens, num_heads, head_dim] of the same shape, got ",
              query.sizes(), " and ", out.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "query and out must be contiguous in head_dim");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_attention supports float32 and bfloat16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "query, out and caches must share one dtype");
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu(),
              "paged_attention runs on CPU tensors only");
  check_int32_cpu(block_tables, "block_tables");
  check_int32_cpu(query_start_loc, "query_start_loc");
  check_int32_cpu(seq_lens, "seq_lens");
  check_int32_cpu(context_lens, "context_lens");
  check_int32_cpu(seq_ids, "seq_ids");
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be 2-D");
  TORCH_CHECK(key.has_value() == value.has_value() && key.has_value() == slot_mapping.has_value(),
              "key, value and slot_mapping: all three or none");
  if (key.has_value()) write_kv_slots(*key, *value, k_cache, v_cache, *slot_mapping);

  Geometry g;
  g.num_heads = query.size(1);
  g.head_dim = query.size(2);
  g.num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == g.head_dim, "cache head_dim ", k_cache.size(3),
              " != query head_dim ", g.head_dim);
  TORCH_CHECK(g.num_heads % g.num_kv_heads == 0, "num_heads ", g.num_heads,
              " is not a multiple of num_kv_heads ", g.num_kv_heads);
  g.group = g.num_heads / g.num_kv_heads;
  g.block_size = k_cache.size(1);
  g.q_stride_t = query.stride(0);
  g.q_stride_h = query.stride(1);
  g.o_stride_t = out.stride(0);
  g.o_stride_h = out.stride(1);
  g.c_stride_block = k_cache.stride(0);
  g.c_stride_tok = k_cache.stride(1);
  g.c_stride_head = k_cache.stride(2);
  g.bt_stride = block_tables.size(1);
  g.scale = static_cast<float>(scale);
  g.soft_cap = logits_soft_cap > 0 ? static_cast<float>(logits_soft_cap) : 0.f;
  g.window = sliding_window > 0 ? sliding_window : 0;

  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* ids = seq_ids.data_ptr<int32_t>();
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_blocks = k_cache.size(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  std::vector<Item> items;
  items.reserve(seq_ids.numel() * g.num_kv_heads);
  for (int64_t i = 0; i < seq_ids.numel(); ++i) {
    const int32_t s = ids[i];
    TORCH_CHECK(s >= 0 && s < num_seqs, "seq_ids[", i, "] = ", s, " out of range [0, ", num_seqs,
                ")");
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 0 && starts[s + 1] <= query.size(0) && ctx[s] + q_len == lens[s],
                "sequence ", s, ": query tokens ", starts[s], "..", starts[s + 1],
                " do not match context_len ", ctx[s], " / seq_len ", lens[s]);
    const int64_t needed = (lens[s] + g.block_size - 1) / g.block_size;
    TORCH_CHECK(needed <= g.bt_stride, "sequence ", s, " needs ", needed,
                " blocks, block table has ", g.bt_stride);
    for (int64_t b = 0; b < needed; ++b) {
      const int32_t blk = tables[s * g.bt_stride + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", s, ", ", b, "] = ", blk,
                  " out of range [0, ", num_blocks, ")");
    }
    for (int64_t t0 = starts[s]; t0 < starts[s + 1]; t0 += kTileTokens) {
      const int32_t t1 = static_cast<int32_t>(std::min<int64_t>(t0 + kTileTokens, starts[s + 1]));
      const int64_t pos_first = ctx[s] + (t0 - starts[s]);
      const int64_t pos_last = ctx[s] + (t1 - 1 - starts[s]);
      const int64_t key_lo = g.window > 0 ? std::max<int64_t>(0, pos_first - g.window + 1) : 0;
      const int64_t cost = (t1 - t0) * (pos_last + 1 - key_lo);
      for (int64_t h = 0; h < g.num_kv_heads; ++h)
        items.push_back({s, static_cast<int32_t>(h), static_cast<int32_t>(t0), t1, cost});
    }
  }
  if (items.empty()) return;
  // Long tiles first, so the dynamic schedule does not end on one long straggler.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });

  TORCH_CHECK(isa >= kPortable && isa <= kAvx512Bf16 && isa_compiled(static_cast<int>(isa)),
              "paged_attention: code path ", isa, " is not compiled into this build");
  // The bf16 dot-product path changes only bfloat16 caches; float32 runs its AVX-512 code.
  if (isa == kAvx512Bf16 && dtype == at::kFloat) isa = kAvx512;
  const bool f32 = dtype == at::kFloat;
  switch (isa) {
#if PAGEDLLM_AVX512_BF16
    case kAvx512Bf16:
      run<kAvx512Bf16, c10::BFloat16>(query, out, k_cache, v_cache, tables, starts, ctx, items, g);
      return;
#endif
#if PAGEDLLM_AVX512
    case kAvx512:
      if (f32) run<kAvx512, float>(query, out, k_cache, v_cache, tables, starts, ctx, items, g);
      else run<kAvx512, c10::BFloat16>(query, out, k_cache, v_cache, tables, starts, ctx, items, g);
      return;
#endif
#if PAGEDLLM_AVX2
    case kAvx2:
      if (f32) run<kAvx2, float>(query, out, k_cache, v_cache, tables, starts, ctx, items, g);
      else run<kAvx2, c10::BFloat16>(query, out, k_cache, v_cache, tables, starts, ctx, items, g);
      return;
#endif
    default:
      if (f32) run<kPortable, float>(query, out, k_cache, v_cache, tables, starts, ctx, items, g);
      else run<kPortable, c10::BFloat16>(query, out, k_cache, v_cache, tables, starts, ctx, items, g);
  }
}

// Names of the code paths compiled into this build, index = the `isa` argument.
std::vector<std::string> compiled_isas() {
  std::vector<std::string> names{"portable"};
  if (PAGEDLLM_AVX2) names.push_back("avx2");
  if (PAGEDLLM_AVX512) names.push_back("avx512");
  if (PAGEDLLM_AVX512_BF16) names.push_back("avx512_bf16");
  return names;
}

bool built_with_avx2() { return PAGEDLLM_AVX2; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: the kernel touches no Python objects, and a server's other threads run.
  m.def("paged_attention", &paged_attention,
        "Paged attention over the block table, in place into out (float32 / bfloat16, CPU); with key, "
        "value and slot_mapping, this step's K/V are written into the caches first",
        py::arg("query"), py::arg("out"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("context_lens"), py::arg("seq_ids"),
        py::arg("scale"), py::arg("sliding_window"), py::arg("logits_soft_cap"), py::arg("isa"),
        py::arg("key") = py::none(), py::arg("value") = py::none(), py::arg("slot_mapping") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("compiled_isas", &compiled_isas,
        "Names of the code paths compiled in; the index of a name is paged_attention's isa argument");
  m.def("built_with_avx2", &built_with_avx2, "True when the AVX2/FMA micro-kernels are compiled in");
}
