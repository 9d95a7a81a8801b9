// All the experts of one float32 MoE layer (SwiGLU experts) in one call: for a step's T tokens and
// their k routed experts,
//
//   out[t] = sum_{j < k} w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, j],
//
// over the stacked packed weights of the experts this rank holds (f32_gemm.h's layout, one
// expert after another: w13 [E, 2I / 16, H, 16] (gate rows, then up rows), w2 [E, H / 16, I, 16]).
//
// Why: a decode step's MoE layer otherwise makes 2 GEMM calls per chosen expert plus a dozen small
// torch ops (sort, gather, scale, scatter, sum), each a call with its own fixed cost; here it is
// one call that runs 2 parallel loops (gate/up + activation, then down + weighted sum).
//
// Arithmetic, the same bits as layers/fused_moe.py's per-expert path (sorted pairs, f32_gemm
// layers, silu(gate) * up, then mul by the weight and the sum of each token's k rows):
//   - gate, up and down outputs: f32_gemm.h's micro-kernels, one FMA chain per output in k order;
//   - silu(g) * u: torch's SiLU (x / (1 + exp(-x)), rounded) times u; on vectors (ATen's vector
//     exp) up to column scalar_from, then the scalar formula (std::exp): I for fused_ops.cpp's
//     silu_and_mul (I is a multiple of 16: all vectors), the end of the last 2-vector step for
//     torch's own kernel (its elementwise loop runs 2 vectors per step and the rest scalar);
//   - the weighted sum: each term w * y rounded, then added in slot order j = 0, 1, ... (torch's
//     sum over the k rows), a pair routed to an expert held by another rank adding +0.
// Compiled with -ffp-contract=off, so no multiply and add are fused beyond the GEMM's own FMAs.
// Every output depends only on its own token's row, so the result is batch-invariant.
//
// Parallel work: phase 1 splits the gate blocks (I / 16) into tiles; a tile runs every expert's
// rows through its gate and its up blocks, then the activation on those columns. Phase 2 splits
// the output blocks (H / 16); a tile runs every expert's rows through its down blocks, then the
// weighted sum on those columns. Each tile reads each expert's part once for up to 12 rows.

#include "vec_isa.h"  // before ATen: selects its vector code

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "f32_gemm.h"

#if PAGEDLLM_F32_GEMM
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();

// out[c] = round(silu(g[c])) * u[c] for the columns c in [c0, c1) (multiples of kW): torch's SiLU,
// on vectors (x / (1 + exp(-x)), ATen's vector exp) before column scalar_from and with the scalar
// formula (std::exp) from it, as torch's elementwise loop runs a row's tail.
inline void silu_mul(const float* g, const float* u, float* out, int64_t c0, int64_t c1, int64_t scalar_from) {
  const fVec one(1.f);
  int64_t c = c0;
  for (; c < std::min(c1, scalar_from); c += kW) {
    const fVec x = fVec::loadu(g + c);
    (x / (one + x.neg().exp()) * fVec::loadu(u + c)).store(out + c);
  }
  for (; c < c1; ++c) out[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
}

// The experts' rows: pairs sorted by local expert (stable), each expert's rows contiguous.
struct Groups {
  std::vector<int64_t> start;   // [E + 1] first sorted row of each local expert
  std::vector<int64_t> pos;     // [T k] sorted row of each (token, slot) pair, -1 if held elsewhere
  int64_t max_rows = 0;         // the most rows of one expert
};

Groups group_pairs(const int64_t* ids, int64_t pairs, int64_t experts, int64_t first) {
  Groups g;
  g.start.assign(experts + 1, 0);
  g.pos.assign(pairs, -1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - first;
    if (e >= 0 && e < experts) ++g.start[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) {
    g.max_rows = std::max(g.max_rows, g.start[e + 1]);
    g.start[e + 1] += g.start[e];
  }
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - first;
    if (e >= 0 && e < experts) g.pos[p] = next[e]++;
  }
  return g;
}

template <int T, int MaxR>
void run_experts(const Groups& g, int64_t tokens, int64_t k, int64_t hidden, int64_t inter, const float* xs,
                 const float* w13, const float* w2, const float* weights, int64_t scalar_from, float* gu, float* act,
                 float* ys, float* out) {
  const int64_t experts = static_cast<int64_t>(g.start.size()) - 1;
  const int64_t inter_blocks = inter / kBlock, hidden_blocks = (hidden + kBlock - 1) / kBlock;
  const int64_t w13_stride = 2 * inter_blocks * hidden * kBlock, w2_stride = hidden_blocks * inter * kBlock;
  const int64_t up_offset = inter_blocks * hidden * kBlock;   // the up rows' blocks follow the gate rows'
  // Phase 1: gate and up blocks [b, b + T) of every expert's rows, then the activation there.
  at::parallel_for(0, (inter_blocks + T - 1) / T, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = T * p;
      const int64_t c0 = b * kBlock, c1 = std::min(inter_blocks, b + T) * kBlock;
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t r0 = g.start[e], m = g.start[e + 1] - r0;
        if (m == 0) continue;
        const float* x = xs + r0 * hidden;
        const float* we = w13 + e * w13_stride;
        float* rows = gu + r0 * 2 * inter;
        run_tile<T, MaxR>(m, x, hidden, we, b, inter_blocks, inter, nullptr, rows, 2 * inter);
        run_tile<T, MaxR>(m, x, hidden, we + up_offset, b, inter_blocks, inter, nullptr, rows + inter, 2 * inter);
        for (int64_t r = 0; r < m; ++r)
          silu_mul(rows + r * 2 * inter, rows + r * 2 * inter + inter, act + (r0 + r) * inter, c0, c1, scalar_from);
      }
    }
  });
  // Phase 2: down blocks [b, b + T) of every expert's rows, then each token's weighted sum there.
  at::parallel_for(0, (hidden_blocks + T - 1) / T, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = T * p;
      const int64_t c0 = b * kBlock, c1 = std::min(hidden, (b + T) * kBlock);
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t r0 = g.start[e], m = g.start[e + 1] - r0;
        if (m > 0)
          run_tile<T, MaxR>(m, act + r0 * inter, inter, w2 + e * w2_stride, b, hidden_blocks, hidden, nullptr,
                            ys + r0 * hidden, hidden);
      }
      for (int64_t t = 0; t < tokens; ++t) {
        float* o = out + t * hidden;
        for (int64_t c = c0; c < c1; ++c) o[c] = 0.f;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = g.pos[t * k + j];
          const float w = weights[t * k + j];
          const float* y = ys + s * hidden;
          if (s < 0) {   // an expert held by another rank: the per-expert path's zero row
            for (int64_t c = c0; c < c1; ++c) o[c] = (j == 0 ? 0.f : o[c] + 0.f);
          } else if (j == 0) {
            for (int64_t c = c0; c < c1; ++c) o[c] = w * y[c];
          } else {
            for (int64_t c = c0; c < c1; ++c) o[c] = o[c] + w * y[c];
          }
        }
      }
    }
  });
}

}  // namespace
#endif  // PAGEDLLM_F32_GEMM

// x [T, H] float32, weights [T, k] float32, ids [T, k] int64 (global expert ids), w13 [E, 2I / 16, H, 16]
// and w2 [E, ceil(H / 16), I, 16] float32 (pack_f32_weight of each local expert's [2I, H] and [H, I]
// weights, stacked), I a multiple of 16, the local experts being ids [first, first + E), the
// activation's scalar formula from column scalar_from (the header) -> [T, H] float32, the header's
// sum over each token's local experts (zeros where none).
at::Tensor f32_moe(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                      const at::Tensor& w13, const at::Tensor& w2, int64_t first_expert, int64_t scalar_from) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.dtype() == at::kFloat && x.device().is_cpu(),
              "x must be a contiguous float32 [T, H] CPU tensor");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == tokens && ids.dtype() == at::kLong && ids.is_contiguous(),
              "ids must be a contiguous int64 [T, k] tensor");
  const int64_t k = ids.size(1);
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.dtype() == at::kFloat && weights.is_contiguous(),
              "weights must be a contiguous float32 [T, k] tensor");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.dtype() == at::kFloat && w2.dtype() == at::kFloat &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "w13 and w2 must be contiguous float32 [E, blocks, K, 16] tensors");
  const int64_t experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(inter % kBlock == 0 && w13.size(1) == 2 * inter / kBlock && w13.size(2) == hidden &&
                  w13.size(3) == kBlock && w2.size(0) == experts && w2.size(1) == (hidden + kBlock - 1) / kBlock &&
                  w2.size(3) == kBlock,
              "w13 must be [E, 2I / 16, H, 16] and w2 [E, ceil(H / 16), I, 16] with I a multiple of 16 (got ",
              w13.sizes(), ", ", w2.sizes(), ", H ", hidden, ")");
  TORCH_CHECK(scalar_from >= 0 && scalar_from <= inter && scalar_from % 8 == 0,
              "scalar_from must be a multiple of 8 in [0, I], got ", scalar_from);
  auto out = cpu_tensor::empty({tokens, hidden}, x.scalar_type());
  if (tokens == 0) return out;
#if PAGEDLLM_F32_GEMM
  const Groups g = group_pairs(ids.data_ptr<int64_t>(), tokens * k, experts, first_expert);
  const int64_t rows = g.start.back();
  auto xs = cpu_tensor::empty({rows, hidden}, x.scalar_type());   // each local pair's token row, sorted by expert
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t p = 0; p < tokens * k; ++p)
    if (g.pos[p] >= 0) std::memcpy(xsp + g.pos[p] * hidden, xp + (p / k) * hidden, hidden * sizeof(float));
  auto gu = cpu_tensor::empty({rows, 2 * inter}, x.scalar_type());
  auto act = cpu_tensor::empty({rows, inter}, x.scalar_type());
  auto ys = cpu_tensor::empty({rows, hidden}, x.scalar_type());
  auto run = g.max_rows >= kLargeFromRows ? run_experts<kLargeT, kLargeRows> : run_experts<kSmallT, kSmallRows>;
  run(g, tokens, k, hidden, inter, xsp, w13.data_ptr<float>(), w2.data_ptr<float>(), weights.data_ptr<float>(),
      (scalar_from / kW) * kW, gu.data_ptr<float>(), act.data_ptr<float>(), ys.data_ptr<float>(), out.data_ptr<float>());
#else
  TORCH_CHECK(false, "f32_moe: built without AVX-512 or AVX2 + FMA");
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_moe", &f32_moe,
        "x [T, H], routing weights / ids [T, k], stacked packed w13 / w2 -> [T, H] float32 (MoE SwiGLU experts)",
        py::arg("x"), py::arg("weights"), py::arg("ids"), py::arg("w13"), py::arg("w2"), py::arg("first_expert"),
        py::arg("scalar_from"));
  m.def("compiled_isas", &compiled_isas, "code paths compiled in");
}
