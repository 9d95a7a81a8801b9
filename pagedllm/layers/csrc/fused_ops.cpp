// Fused CPU ops for the elementwise work between the GEMMs of a decoder layer (float32, bfloat16).
//
// Each op does in one pass over a row what the eager torch code (pagedllm/layers/*.py,
// pagedllm/models/*.py; the reference, see pagedllm/layers/fused_ops.py) does in several ops, each
// reading and writing the whole tensor and casting between bfloat16 and float32:
//   gemma_rms_norm        (x / rms(x)) * (1 + w), float32 math, one cast (Gemma3RMSNorm);
//   gemma_add_rms_norm    new_residual = residual + post_norm(h); x = pre_norm(new_residual)
//                         (the "sandwich" norm step between two sub-blocks of a Gemma 3 layer);
//   gemma_qk_norm_rope_   per-head q/k Gemma RMSNorm, then RoPE (rotate_half layout), in place
//                         on the merged qkv projection's output;
//   gelu_tanh_and_mul     gelu_tanh(gate) * up on the merged gate_up output ([T, 2I] -> [T, I]);
//   rms_norm              Llama RMSNorm: w * cast(x / rms(x)) (LlamaRMSNorm);
//   add_rms_norm          Llama residual step: new_residual = residual + h; x = rms_norm(new_residual);
//   qk_norm_rope_         Llama / Qwen RoPE in place on qkv (after Qwen3's per-head RMSNorm);
//   silu_and_mul          silu(gate) * up ([T, 2I] -> [T, I]);
//   greedy_argmax         per row the index of the first maximum (of the first NaN, if any), as
//                         torch's max(dim).indices / argmax: the sampler's plain greedy rows.
// All sums are float32. bfloat16 values are rounded (round to nearest even, as torch) at exactly
// the points where the eager code produces a bfloat16 tensor, so an op differs from the eager code
// only by the order of the float32 sum of squares (a few float32 ulp of the inverse rms; at most
// one bfloat16 ulp, and rarely, after the cast) and, for the activations, by nothing: they use the
// same formula and the same vector tanh / exp (SLEEF, from libtorch) as torch's AVX2/AVX-512 kernels.
//
// Vector code: ATen's at::vec::Vectorized<float>, compiled for the widest set -march=native allows
// (AVX-512: 16 lanes, AVX2: 8, else ATen's portable loops); compiled_isas() names it. Compiled with
// -ffp-contract=off: a multiply followed by an add is rounded twice, as in the eager code.
// Rows are split over at::parallel_for threads only when a call has many elements (prefill); a
// decode step's few rows run on the calling thread.

#include "vec_isa.h"  // before ATen: selects its vector code

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <limits>
#include <cstdint>
#include <string>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using BF16 = c10::BFloat16;
using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();
// A call with at least this many elements splits its rows over threads.
constexpr int64_t kParallelElems = 1 << 15;

// ---- loads and stores of kW float32 lanes (n < kW: a partial vector, the other lanes 0) ----

inline fVec load(const float* p) { return fVec::loadu(p); }
inline fVec load(const float* p, int64_t n) { return n == kW ? fVec::loadu(p) : fVec::loadu(p, n); }
inline void store(float* p, const fVec& v) { v.store(p); }
inline void store(float* p, const fVec& v, int64_t n) { v.store(p, n); }

inline fVec load(const BF16* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  fVec v;
  at::vec::load_fp32_from_bf16(p, v);
  return v;
#else
  float buf[kW];
  for (int64_t i = 0; i < kW; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
#endif
}
inline fVec load(const BF16* p, int64_t n) {
  if (n == kW) return load(p);
  float buf[kW] = {0};
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
}
inline void store(BF16* p, const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));  // one vector, RNE
#elif defined(CPU_CAPABILITY_AVX2)
  at::vec::convert_float_bfloat16(v, v).store(p, kW);
#else
  float buf[kW];
  v.store(buf);
  for (int64_t i = 0; i < kW; ++i) p[i] = BF16(buf[i]);
#endif
}
inline void store(BF16* p, const fVec& v, int64_t n) {
  if (n == kW) return store(p, v);
  float buf[kW];
  v.store(buf);
  for (int64_t i = 0; i < n; ++i) p[i] = BF16(buf[i]);
}

// The value a tensor of dtype T holds after the eager code writes v into it.
template <typename T>
inline fVec round_to(const fVec& v);
template <>
inline fVec round_to<float>(const fVec& v) { return v; }
template <>
inline fVec round_to<BF16>(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  // As at::vec::cvtfp32_bf16 (round to nearest even, NaN kept), without leaving the float32 lanes:
  // bits + 0x7fff + lsb, low 16 bits cleared.
  const __m512 x = v;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  return fVec(_mm512_mask_blend_ps(ordered, x, _mm512_castsi512_ps(r)));
#elif defined(CPU_CAPABILITY_AVX2)
  return std::get<0>(at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(v, v)));
#else
  float buf[kW];
  v.store(buf);
  for (int64_t i = 0; i < kW; ++i) buf[i] = static_cast<float>(BF16(buf[i]));
  return fVec::loadu(buf);
#endif
}

// Pairwise (tree) sum of the lanes.
inline float horizontal_sum(const fVec& v) {
  float buf[kW];
  v.store(buf);
  for (int64_t w = kW / 2; w >= 1; w /= 2) {
    for (int64_t i = 0; i < w; ++i) buf[i] = buf[i] + buf[i + w];
  }
  return buf[0];
}

// float32 sum of x[i]^2 over a row of n.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  fVec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    fVec v0 = load(x + i), v1 = load(x + i + kW), v2 = load(x + i + 2 * kW), v3 = load(x + i + 3 * kW);
    a0 = a0 + v0 * v0;
    a1 = a1 + v1 * v1;
    a2 = a2 + v2 * v2;
    a3 = a3 + v3 * v3;
  }
  for (; i < n; i += kW) {
    fVec v = load(x + i, std::min<int64_t>(kW, n - i));
    a0 = a0 + v * v;
  }
  return horizontal_sum((a0 + a1) + (a2 + a3));
}

// 1 / sqrt(mean + eps), as the eager code: sum / n, + eps, rsqrt (each rounded to float32).
inline float inv_rms(float sum_sq, int64_t n, float eps) {
  const float mean = sum_sq / static_cast<float>(n);
  return 1.f / std::sqrt(mean + eps);
}

// out[i] = round_T((x[i] * r) * w1[i]): Gemma's normalised row times (1 + w), w1 float32.
template <typename T>
inline void scale_row(const T* x, float r, const float* w1, T* out, int64_t n) {
  const fVec rv(r);
  for (int64_t i = 0; i < n; i += kW) {
    const int64_t m = std::min<int64_t>(kW, n - i);
    store(out + i, (load(x + i, m) * rv) * load(w1 + i, m), m);
  }
}

template <typename F>
inline void for_rows(int64_t rows, int64_t row_elems, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, row_elems));
  if (rows <= grain) {
    fn(0, rows);
  } else {
    at::parallel_for(0, rows, grain, fn);
  }
}

// Runs fn(scalar_t{}) for the dtype (float32 or bfloat16; check_float_cpu has checked it).
template <typename F>
inline void dispatch(at::ScalarType dtype, const F& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else {
    fn(BF16{});
  }
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_weight(const at::Tensor& w, int64_t n, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n,
              name, " must be a contiguous float32 CPU tensor of ", n, " elements");
}

// ---------------------------------- Gemma RMSNorm ----------------------------------

at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight_plus_one, double eps) {
  check_float_cpu(x, "x");
  const int64_t n = x.size(-1);
  check_weight(weight_plus_one, n, "weight_plus_one");
  const int64_t rows = n ? x.numel() / n : 0;
  at::Tensor out = cpu_tensor::empty_like(x);
  const float* w1 = weight_plus_one.data_ptr<float>();
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * n;
        scale_row(row, inv_rms(sum_squares(row, n), n, static_cast<float>(eps)), w1, op + r * n, n);
      }
    });
  });
  return out;
}

// ------------------ Gemma residual step: residual + post_norm(h), then pre_norm ------------------

std::tuple<at::Tensor, at::Tensor> gemma_add_rms_norm(const at::Tensor& h, const at::Tensor& residual,
                                                      const at::Tensor& post_weight_plus_one,
                                                      const at::Tensor& pre_weight_plus_one, double post_eps,
                                                      double pre_eps) {
  check_float_cpu(h, "h");
  check_float_cpu(residual, "residual");
  TORCH_CHECK(h.sizes() == residual.sizes() && h.scalar_type() == residual.scalar_type(),
              "h and residual must have the same shape and dtype");
  const int64_t n = h.size(-1);
  check_weight(post_weight_plus_one, n, "post_weight_plus_one");
  check_weight(pre_weight_plus_one, n, "pre_weight_plus_one");
  const int64_t rows = n ? h.numel() / n : 0;
  at::Tensor new_residual = cpu_tensor::empty_like(h);
  at::Tensor out = cpu_tensor::empty_like(h);
  const float* wpost = post_weight_plus_one.data_ptr<float>();
  const float* wpre = pre_weight_plus_one.data_ptr<float>();
  dispatch(h.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* nrp = new_residual.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* hrow = hp + r * n;
        const scalar_t* rrow = rp + r * n;
        scalar_t* nrow = nrp + r * n;
        const fVec r1(inv_rms(sum_squares(hrow, n), n, static_cast<float>(post_eps)));
        fVec acc(0.f);
        for (int64_t i = 0; i < n; i += kW) {
          const int64_t m = std::min<int64_t>(kW, n - i);
          const fVec post = round_to<scalar_t>((load(hrow + i, m) * r1) * load(wpost + i, m));
          const fVec sum = round_to<scalar_t>(load(rrow + i, m) + post);
          store(nrow + i, sum, m);
          acc = acc + sum * sum;   // lanes past m are 0
        }
        scale_row(nrow, inv_rms(horizontal_sum(acc), n, static_cast<float>(pre_eps)), wpre, op + r * n, n);
      }
    });
  });
  return {new_residual, out};
}

// ---------------------- q/k Gemma RMSNorm per head, then RoPE, in place ----------------------

// One head row x[D] (in place): n = round(norm(x)); x1' = round(round(n1 c1) + round(-n2 s1)),
// x2' = round(round(n2 c2) + round(n1 s2)) for the halves 1, 2 (rotate_half layout).
template <typename T>
inline void norm_rope_row(T* x, const float* w1, const T* cos, const T* sin, int64_t d, float eps) {
  const fVec r(inv_rms(sum_squares(x, d), d, eps));
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += kW) {
    const int64_t m = std::min<int64_t>(kW, half - i);
    const fVec n1 = round_to<T>((load(x + i, m) * r) * load(w1 + i, m));
    const fVec n2 = round_to<T>((load(x + half + i, m) * r) * load(w1 + half + i, m));
    const fVec c1 = load(cos + i, m), c2 = load(cos + half + i, m);
    const fVec s1 = load(sin + i, m), s2 = load(sin + half + i, m);
    const fVec o1 = round_to<T>(round_to<T>(n1 * c1) + round_to<T>(n2.neg() * s1));
    const fVec o2 = round_to<T>(round_to<T>(n2 * c2) + round_to<T>(n1 * s2));
    store(x + i, o1, m);
    store(x + half + i, o2, m);
  }
}

void gemma_qk_norm_rope_(at::Tensor& qkv, const at::Tensor& q_weight_plus_one, const at::Tensor& k_weight_plus_one,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                         double q_eps, double k_eps) {
  check_float_cpu(qkv, "qkv");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  TORCH_CHECK(qkv.dim() == 2, "qkv must be [num_tokens, (num_heads + 2 num_kv_heads) head_dim]");
  const int64_t d = q_weight_plus_one.numel();
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "qkv width ", qkv.size(1),
              " != (num_heads + 2 num_kv_heads) head_dim");
  check_weight(q_weight_plus_one, d, "q_weight_plus_one");
  check_weight(k_weight_plus_one, d, "k_weight_plus_one");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(cos.numel() == tokens * d && sin.numel() == tokens * d, "cos and sin must be [num_tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must have qkv's dtype");
  const int64_t width = qkv.size(1);
  const float* wq = q_weight_plus_one.data_ptr<float>();
  const float* wk = k_weight_plus_one.data_ptr<float>();
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    for_rows(tokens, (num_heads + num_kv_heads) * d, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* row = base + t * width;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          const bool is_q = h < num_heads;
          norm_rope_row(row + h * d, is_q ? wq : wk, cp + t * d, sp + t * d, d,
                        static_cast<float>(is_q ? q_eps : k_eps));
        }
      }
    });
  });
}

// ----------------------------- gated activations: act(gate) * up -----------------------------

// torch's GELU (tanh approximation) on float32 vectors, same constants and order as
// at::native::vectorized_gelu_approximated_with_tanh (ATen/native/cpu/Gelu.h):
// 0.5 x (1 + tanh(beta (x + kappa x^3))), float32 constants for bfloat16 inputs too. torch's own
// build contracts x + kappa x^3 into one FMA; so does this (measured: bitwise equal that way).
struct GeluTanh {
  fVec beta, kappa, one, half;
  GeluTanh()
      : beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715f), one(1.f), half(0.5f) {}
  fVec operator()(const fVec& x) const {
    const fVec x_cube = x * x * x;
    const fVec inner = beta * at::vec::fmadd(kappa, x_cube, x);
    return half * x * (one + inner.tanh());
  }
  // torch's scalar tail (scalar_gelu_approximated_with_tanh), for the elements past the last full vector.
  float operator()(float x) const {
    const float x_cube = x * x * x;
    const float inner = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5) * std::fma(0.044715f, x_cube, x);
    return 0.5f * x * (1.f + std::tanh(inner));
  }
};

// torch's SiLU on float32 vectors (SiLUKernel): x / (1 + exp(-x)).
struct Silu {
  fVec one;
  Silu() : one(1.f) {}
  fVec operator()(const fVec& x) const { return x / (one + x.neg().exp()); }
  float operator()(float x) const { return x / (1.f + std::exp(-x)); }
};

template <typename Act>
at::Tensor act_and_mul(const at::Tensor& gate_up) {
  check_float_cpu(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "gate_up's last dimension must be even");
  const int64_t inter = two_i / 2;
  const int64_t rows = two_i ? gate_up.numel() / two_i : 0;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor out = cpu_tensor::empty(shape, gate_up.scalar_type());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const Act act;
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, two_i, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = gp + r * two_i;
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        int64_t i = 0;
        for (; i + kW <= inter; i += kW) {
          store(o + i, round_to<scalar_t>(act(load(g + i))) * load(u + i));
        }
        for (; i < inter; ++i) {  // as torch's elementwise loops: the tail runs the scalar formula
          const scalar_t a = static_cast<scalar_t>(act(static_cast<float>(g[i])));
          o[i] = static_cast<scalar_t>(static_cast<float>(a) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) { return act_and_mul<GeluTanh>(gate_up); }
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return act_and_mul<Silu>(gate_up); }

// ---------------------------------- Llama RMSNorm ----------------------------------

// out = round(w * round(x / rms(x))), w in the model dtype (LlamaRMSNorm: normalise in float32,
// cast, then the weight multiply in the model dtype).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_cpu(x, "x");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == n,
              "weight must be a contiguous tensor of ", n, " elements in x's dtype");
  const int64_t rows = n ? x.numel() / n : 0;
  at::Tensor out = cpu_tensor::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * n;
        const fVec rv(inv_rms(sum_squares(row, n), n, static_cast<float>(eps)));
        for (int64_t i = 0; i < n; i += kW) {
          const int64_t m = std::min<int64_t>(kW, n - i);
          store(op + r * n + i, load(wp + i, m) * round_to<scalar_t>(load(row + i, m) * rv), m);
        }
      }
    });
  });
  return out;
}

// Llama residual step: new_residual = round(residual + h); out = rms_norm(new_residual) (as above).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_float_cpu(h, "h");
  check_float_cpu(residual, "residual");
  TORCH_CHECK(h.sizes() == residual.sizes() && h.scalar_type() == residual.scalar_type(),
              "h and residual must have the same shape and dtype");
  const int64_t n = h.size(-1);
  TORCH_CHECK(weight.scalar_type() == h.scalar_type() && weight.is_contiguous() && weight.numel() == n,
              "weight must be a contiguous tensor of ", n, " elements in h's dtype");
  const int64_t rows = n ? h.numel() / n : 0;
  at::Tensor new_residual = cpu_tensor::empty_like(h);
  at::Tensor out = cpu_tensor::empty_like(h);
  dispatch(h.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* nrp = new_residual.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* nrow = nrp + r * n;
        fVec acc(0.f);
        for (int64_t i = 0; i < n; i += kW) {
          const int64_t m = std::min<int64_t>(kW, n - i);
          const fVec sum = round_to<scalar_t>(load(rp + r * n + i, m) + load(hp + r * n + i, m));
          store(nrow + i, sum, m);
          acc = acc + sum * sum;   // lanes past m are 0
        }
        const fVec rv(inv_rms(horizontal_sum(acc), n, static_cast<float>(eps)));
        for (int64_t i = 0; i < n; i += kW) {
          const int64_t m = std::min<int64_t>(kW, n - i);
          store(op + r * n + i, load(wp + i, m) * round_to<scalar_t>(load(nrow + i, m) * rv), m);
        }
      }
    });
  });
  return {new_residual, out};
}

// Llama / Qwen RoPE in place on qkv's q and k heads, after Qwen3's per-head Llama RMSNorm when
// weights are given (n = round(w * round(x / rms(x))), w in qkv's dtype).
template <typename T>
inline void llama_norm_rope_row(T* x, const T* w, const T* cos, const T* sin, int64_t d, float eps) {
  const fVec r(w != nullptr ? inv_rms(sum_squares(x, d), d, eps) : 1.f);
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += kW) {
    const int64_t m = std::min<int64_t>(kW, half - i);
    fVec n1 = load(x + i, m), n2 = load(x + half + i, m);
    if (w != nullptr) {
      n1 = round_to<T>(load(w + i, m) * round_to<T>(n1 * r));
      n2 = round_to<T>(load(w + half + i, m) * round_to<T>(n2 * r));
    }
    const fVec c1 = load(cos + i, m), c2 = load(cos + half + i, m);
    const fVec s1 = load(sin + i, m), s2 = load(sin + half + i, m);
    store(x + i, round_to<T>(round_to<T>(n1 * c1) + round_to<T>(n2.neg() * s1)), m);
    store(x + half + i, round_to<T>(round_to<T>(n2 * c2) + round_to<T>(n1 * s2)), m);
  }
}

void qk_norm_rope_(at::Tensor& qkv, const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, double eps) {
  check_float_cpu(qkv, "qkv");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  const int64_t d = head_dim;
  TORCH_CHECK(qkv.dim() == 2 && d % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "qkv must be [num_tokens, (num_heads + 2 num_kv_heads) head_dim] with an even head_dim");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "q_weight and k_weight: both or neither");
  for (const auto* w : {&q_weight, &k_weight}) {
    if (w->has_value()) {
      TORCH_CHECK((*w)->scalar_type() == qkv.scalar_type() && (*w)->is_contiguous() && (*w)->numel() == d,
                  "q/k norm weights must be contiguous [head_dim] in qkv's dtype");
    }
  }
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(cos.numel() == tokens * d && sin.numel() == tokens * d, "cos and sin must be [num_tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must have qkv's dtype");
  const int64_t width = qkv.size(1);
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const scalar_t* wq = q_weight.has_value() ? q_weight->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wk = k_weight.has_value() ? k_weight->data_ptr<scalar_t>() : nullptr;
    for_rows(tokens, (num_heads + num_kv_heads) * d, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          llama_norm_rope_row(base + t * width + h * d, h < num_heads ? wq : wk, cp + t * d, sp + t * d, d,
                              static_cast<float>(eps));
        }
      }
    });
  });
}

// ---------------------------------- greedy argmax ----------------------------------

// Index of the first maximum of x[0..n) (n >= 1), or of the first NaN if there is one: torch's
// max(dim).indices / argmax on the CPU (-0.0 == 0.0; -inf rows give 0). Two passes: the vector
// maximum (NaN-propagating), then the first lane equal to it. Exact: only compares, no arithmetic.
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  const int64_t full = n - n % kW;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  if (full) {
    fVec vm = load(x);
    for (int64_t i = kW; i < full; i += kW) vm = at::vec::maximum(vm, load(x + i));
    float lanes[kW];
    vm.store(lanes);
    for (int64_t j = 0; j < kW; ++j) {
      if (std::isnan(lanes[j])) nan = true;
      else if (lanes[j] > m) m = lanes[j];
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) nan = true;
    else if (v > m) m = v;
  }
  const fVec mv(m);
  constexpr int all_miss = (1 << kW) - 1;
  for (int64_t i = 0; i < full; i += kW) {
    const fVec v = load(x + i);
    const int miss = nan ? v.isnan().zero_mask() : (v == mv).zero_mask();   // bit j set: lane j differs
    if (miss != all_miss) {
      for (int64_t j = 0; j < kW; ++j) {
        if (!((miss >> j) & 1)) return i + j;
      }
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (nan ? std::isnan(v) : v == m) return i;
  }
  return 0;  // not reached: some element equals the maximum
}

// [N, V] logits -> [N] int64: each row's greedy token (see row_argmax).
at::Tensor greedy_argmax(const at::Tensor& logits) {
  check_float_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [num_rows, vocab] with vocab >= 1");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = cpu_tensor::empty({rows}, at::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  dispatch(logits.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = logits.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * n, n);
    });
  });
  return out;
}

std::vector<std::string> compiled_isas() { return {PAGEDLLM_VEC_NAME}; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedllm fused CPU ops (see pagedllm/layers/fused_ops.py)";
  m.def("gemma_rms_norm", &gemma_rms_norm, "(x / rms(x)) * weight_plus_one", py::arg("x"),
        py::arg("weight_plus_one"), py::arg("eps"));
  m.def("gemma_add_rms_norm", &gemma_add_rms_norm,
        "(new_residual, pre_norm(new_residual)) with new_residual = residual + post_norm(h)", py::arg("h"),
        py::arg("residual"), py::arg("post_weight_plus_one"), py::arg("pre_weight_plus_one"), py::arg("post_eps"),
        py::arg("pre_eps"));
  m.def("gemma_qk_norm_rope_", &gemma_qk_norm_rope_, "per-head q/k Gemma RMSNorm then RoPE, in place on qkv",
        py::arg("qkv"), py::arg("q_weight_plus_one"), py::arg("k_weight_plus_one"), py::arg("cos"), py::arg("sin"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("q_eps"), py::arg("k_eps"));
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up over [..., 2I] -> [..., I]",
        py::arg("gate_up"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over [..., 2I] -> [..., I]", py::arg("gate_up"));
  m.def("rms_norm", &rms_norm, "Llama RMSNorm: weight * cast(x / rms(x))", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm,
        "(new_residual, rms_norm(new_residual)) with new_residual = residual + h (Llama)", py::arg("h"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("qk_norm_rope_", &qk_norm_rope_,
        "RoPE in place on qkv's q and k heads, after per-head Llama RMSNorm when weights are given",
        py::arg("qkv"), py::arg("q_weight"), py::arg("k_weight"), py::arg("cos"), py::arg("sin"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"));
  m.def("greedy_argmax", &greedy_argmax, "[N, V] -> [N] int64: first index of each row's maximum (first NaN)",
        py::arg("logits"));
  m.def("compiled_isas", &compiled_isas, "the vector code path compiled in: avx512, avx2 or portable");
}
