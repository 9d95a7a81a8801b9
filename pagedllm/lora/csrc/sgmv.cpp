// LoRA deltas of a batch mixing adapters in one call per layer (float32, bfloat16): Punica's
// SGMV / BGMV (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") on the CPU.
//
//   sgmv_add_(y, x, lora_a, lora_b, ranks, row_slots)
//
// For every row t with slot s = row_slots[t] >= 0 (-1: no adapter) and every output slice j of
// the layer with r = ranks[s, j] > 0 (0: the slot's adapter does not target the slice):
//   h = A[s, j, :r] @ x[t]                 (shrink, float32 sums)
//   y[t, slice j] += h @ B_j[s, :r, :]      (expand, float32 sums, one rounding into y)
// No padding over slots or ranks. Rows are bucketed by slot (a counting sort) and run in blocks of
// up to kRowBlock rows of one slot, so each A / B vector loaded is used for every row of the block.
// Blocks are split over at::parallel_for threads when a call has enough work (prefill); a decode
// step's few rows run on the calling thread.
//
// Layouts (pagedllm/lora/layers.py): A [max_loras, n_slices, r_max, in] (rows of each slice
// contiguous, the shrink's dot products run along `in`); B_j [max_loras, r_max, out_j] (B
// transposed per slot, the expand streams rows of B_j along the output).
//
// Vector code: ATen's at::vec::Vectorized<float>, compiled for the widest set -march=native allows
// (AVX-512: 16 lanes, AVX2: 8, else ATen's portable loops); compiled_isas() names it. bfloat16 is
// loaded and stored through ATen's conversions (round to nearest even, as torch).

#include "../../layers/csrc/vec_isa.h"  // before ATen: selects its vector code

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

namespace {

using BF16 = c10::BFloat16;
using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<BF16>;
constexpr int64_t kW = fVec::size();
constexpr int64_t kPair = 2 * kW;        // elements per step: one bfloat16 vector, two float32 ones
constexpr int64_t kRowBlock = 4;         // rows of one slot sharing each weight load (slice_rows<1..4>)
constexpr int64_t kParallelMacs = 1 << 18;   // a call with fewer multiply-adds runs on one thread

// ---- kPair elements as two float32 vectors (n < kPair: the first n, the other lanes 0) ----

inline void load_pair(const float* p, int64_t n, fVec& lo, fVec& hi) {
  if (n == kPair) {
    lo = fVec::loadu(p);
    hi = fVec::loadu(p + kW);
  } else {
    lo = fVec::loadu(p, std::min(n, kW));
    hi = n > kW ? fVec::loadu(p + kW, n - kW) : fVec(0.f);
  }
}
inline void load_pair(const BF16* p, int64_t n, fVec& lo, fVec& hi) {
  const bVec v = n == kPair ? bVec::loadu(p) : bVec::loadu(p, n);
  std::tie(lo, hi) = at::vec::convert_bfloat16_float(v);
}
inline void store_pair(float* p, int64_t n, const fVec& lo, const fVec& hi) {
  if (n == kPair) {
    lo.store(p);
    hi.store(p + kW);
  } else {
    lo.store(p, std::min(n, kW));
    if (n > kW) hi.store(p + kW, n - kW);
  }
}
inline void store_pair(BF16* p, int64_t n, const fVec& lo, const fVec& hi) {
  const bVec v = at::vec::convert_float_bfloat16(lo, hi);
  if (n == kPair) {
    v.store(p);
  } else {
    v.store(p, n);
  }
}

// h[b * r + k] = A[k] . xf[b] for k0 <= k < k0 + KB, b < NB: float32 sums along `in`; each A
// vector loaded serves NB rows, each x vector KB ranks (KB x NB accumulators in registers).
template <int NB, int KB, typename TW>
void shrink_tile(const TW* a, int64_t k0, int64_t r, int64_t in, const float* xf, float* h) {
  fVec acc[KB][NB];
  for (int k = 0; k < KB; ++k) {
    for (int b = 0; b < NB; ++b) acc[k][b] = fVec(0.f);
  }
  for (int64_t i = 0; i < in; i += kPair) {
    const int64_t n = std::min(kPair, in - i);
    fVec alo[KB], ahi[KB];
    for (int k = 0; k < KB; ++k) load_pair(a + (k0 + k) * in + i, n, alo[k], ahi[k]);
    for (int b = 0; b < NB; ++b) {
      fVec xlo, xhi;
      load_pair(xf + b * in + i, n, xlo, xhi);
      for (int k = 0; k < KB; ++k) acc[k][b] = at::vec::fmadd(ahi[k], xhi, at::vec::fmadd(alo[k], xlo, acc[k][b]));
    }
  }
  for (int k = 0; k < KB; ++k) {
    for (int b = 0; b < NB; ++b) {
      h[b * r + k0 + k] = at::vec::vec_reduce_all<float>([](const fVec& u, const fVec& v) { return u + v; }, acc[k][b]);
    }
  }
}

// The shrink of NB rows: h [NB, r] = xf [NB, in] @ A[:r]^T.
template <int NB, typename TW>
void shrink(const TW* a, int64_t r, int64_t in, const float* xf, float* h) {
  constexpr int kRankBlock = 4;
  int64_t k0 = 0;
  for (; k0 + kRankBlock <= r; k0 += kRankBlock) shrink_tile<NB, kRankBlock>(a, k0, r, in, xf, h);
  for (; k0 < r; ++k0) shrink_tile<NB, 1>(a, k0, r, in, xf, h);
}

// The expand of NB rows: y_rows[b][o] += sum_k h[b * r + k] * B[k][o] for o < out (y_rows[b]: row
// b's slice start); each B vector loaded serves NB rows, y is read and written once.
template <int NB, typename TW, typename TY>
void expand(const TW* bt, int64_t r, int64_t out, const float* h, TY* const* y_rows) {
  for (int64_t o = 0; o < out; o += kPair) {
    const int64_t n = std::min(kPair, out - o);
    fVec acc[NB][2];
    for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = fVec(0.f);
    for (int64_t k = 0; k < r; ++k) {
      fVec lo, hi;
      load_pair(bt + k * out + o, n, lo, hi);
      for (int b = 0; b < NB; ++b) {
        const fVec hk(h[b * r + k]);
        acc[b][0] = at::vec::fmadd(lo, hk, acc[b][0]);
        acc[b][1] = at::vec::fmadd(hi, hk, acc[b][1]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      fVec ylo, yhi;
      load_pair(y_rows[b] + o, n, ylo, yhi);
      store_pair(y_rows[b] + o, n, ylo + acc[b][0], yhi + acc[b][1]);
    }
  }
}

// One slice of NB rows of one slot: shrink then expand (xf [NB, in] float32, h [NB, r] scratch).
template <int NB, typename TW, typename TY>
void slice_rows(const TW* a, const TW* bt, int64_t r, int64_t in, int64_t out, const float* xf, float* h,
                TY* const* y_rows) {
  shrink<NB>(a, r, in, xf, h);
  expand<NB>(bt, r, out, h, y_rows);
}

// The rows of each slot, grouped, in blocks of up to kRowBlock rows of one slot.
struct Groups {
  std::vector<int64_t> order;                 // row indices, by slot
  std::vector<std::array<int64_t, 3>> blocks; // (slot, offset into order, rows <= kRowBlock)
};

Groups group_rows(const int64_t* row_slots, int64_t rows, int64_t slots) {
  std::vector<int64_t> start(slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t s = row_slots[t];
    TORCH_CHECK(s >= -1 && s < slots, "row ", t, " has slot ", s, ", outside [-1, ", slots, ")");
    if (s >= 0) ++start[s + 1];
  }
  for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
  Groups g;
  g.order.resize(start[slots]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < rows; ++t) {
    if (row_slots[t] >= 0) g.order[fill[row_slots[t]]++] = t;
  }
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t o = start[s]; o < start[s + 1]; o += kRowBlock) {
      g.blocks.push_back({s, o, std::min(kRowBlock, start[s + 1] - o)});
    }
  }
  return g;
}

template <typename TW, typename TY>
void sgmv_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const std::vector<at::Tensor>& lora_b,
                const int32_t* ranks, const Groups& g) {
  const int64_t n_slices = lora_a.size(1), r_max = lora_a.size(2), in = lora_a.size(3);
  std::vector<const TW*> b_ptr;
  std::vector<int64_t> widths, starts;
  int64_t out = 0;
  for (const auto& b : lora_b) {
    b_ptr.push_back(b.data_ptr<TW>());
    widths.push_back(b.size(2));
    starts.push_back(out);
    out += b.size(2);
  }
  TORCH_CHECK(out == y.size(1), "the slices of B cover ", out, " features, y has ", y.size(1));
  const TW* a = lora_a.data_ptr<TW>();
  const TW* xp = x.data_ptr<TW>();
  TY* yp = y.data_ptr<TY>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const int64_t blocks = static_cast<int64_t>(g.blocks.size());
  const int64_t macs = kRowBlock * n_slices * r_max * (in + out / std::max<int64_t>(n_slices, 1));
  const int64_t grain = std::max<int64_t>(1, kParallelMacs / std::max<int64_t>(macs, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t q0, int64_t q1) {
    std::vector<float> xf(kRowBlock * in), h(kRowBlock * r_max);
    for (int64_t q = q0; q < q1; ++q) {
      const auto& blk = g.blocks[q];
      const int64_t s = blk[0], nb = blk[2];
      const int64_t* rows = g.order.data() + blk[1];
      for (int64_t b = 0; b < nb; ++b) {
        const TW* xr = xp + rows[b] * xs;
        for (int64_t i = 0; i < in; ++i) xf[b * in + i] = static_cast<float>(xr[i]);
      }
      for (int64_t j = 0; j < n_slices; ++j) {
        const int64_t r = ranks[s * n_slices + j];
        if (r <= 0) continue;
        TY* y_rows[kRowBlock];
        for (int64_t b = 0; b < nb; ++b) y_rows[b] = yp + rows[b] * ys + starts[j];
        const TW* aj = a + (s * n_slices + j) * r_max * in;
        const TW* bj = b_ptr[j] + s * r_max * widths[j];
        switch (nb) {
          case 1: slice_rows<1>(aj, bj, r, in, widths[j], xf.data(), h.data(), y_rows); break;
          case 2: slice_rows<2>(aj, bj, r, in, widths[j], xf.data(), h.data(), y_rows); break;
          case 3: slice_rows<3>(aj, bj, r, in, widths[j], xf.data(), h.data(), y_rows); break;
          default: slice_rows<4>(aj, bj, r, in, widths[j], xf.data(), h.data(), y_rows); break;
        }
      }
    }
  });
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

// y [T, out] (float32 / bfloat16, rows may be strided) += the LoRA delta of each row's slot, in place.
// x [T, in], lora_a [S, n_slices, r_max, in], lora_b n_slices x [S, r_max, out_j]: one dtype (float32
// or bfloat16); ranks [S, n_slices] int32 (0: no delta); row_slots [T] int64 (-1: no adapter).
void sgmv_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const std::vector<at::Tensor>& lora_b,
               const at::Tensor& ranks, const at::Tensor& row_slots) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&y, &x, &lora_a, &ranks, &row_slots}) {
    TORCH_CHECK(t->device().is_cpu(), "sgmv_add_ takes CPU tensors");
  }
  TORCH_CHECK(is_float_or_bf16(y) && is_float_or_bf16(x), "sgmv_add_: y and x must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == lora_a.scalar_type(), "sgmv_add_: x and A must share a dtype");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && lora_a.dim() == 4, "sgmv_add_: y, x 2-D; A 4-D");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1 && lora_a.is_contiguous(), "sgmv_add_: rows must be contiguous");
  const int64_t slots = lora_a.size(0), n_slices = lora_a.size(1);
  TORCH_CHECK(x.size(1) == lora_a.size(3), "sgmv_add_: x has ", x.size(1), " features, A ", lora_a.size(3));
  TORCH_CHECK(static_cast<int64_t>(lora_b.size()) == n_slices, "sgmv_add_: one B per slice of A");
  for (const auto& b : lora_b) {
    TORCH_CHECK(b.device().is_cpu() && b.is_contiguous() && b.scalar_type() == lora_a.scalar_type() &&
                    b.dim() == 3 && b.size(0) == slots && b.size(1) == lora_a.size(2),
                "sgmv_add_: each B must be a contiguous CPU [S, r_max, out_j] tensor of A's dtype");
  }
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.numel() == slots * n_slices,
              "sgmv_add_: ranks must be [S, n_slices] int32");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.dim() == 1 && row_slots.is_contiguous() &&
                  row_slots.size(0) == x.size(0) && y.size(0) == x.size(0),
              "sgmv_add_: row_slots must be [T] int64 for T = x's and y's rows");
  const int32_t* rk = ranks.data_ptr<int32_t>();
  for (int64_t i = 0; i < slots * n_slices; ++i) {
    TORCH_CHECK(rk[i] >= 0 && rk[i] <= lora_a.size(2), "sgmv_add_: a rank outside [0, r_max]");
  }
  const Groups g = group_rows(row_slots.data_ptr<int64_t>(), x.size(0), slots);
  const bool w_bf16 = x.scalar_type() == at::kBFloat16, y_bf16 = y.scalar_type() == at::kBFloat16;
  if (w_bf16 && y_bf16) {
    sgmv_typed<BF16, BF16>(y, x, lora_a, lora_b, rk, g);
  } else if (w_bf16) {
    sgmv_typed<BF16, float>(y, x, lora_a, lora_b, rk, g);
  } else if (y_bf16) {
    sgmv_typed<float, BF16>(y, x, lora_a, lora_b, rk, g);
  } else {
    sgmv_typed<float, float>(y, x, lora_a, lora_b, rk, g);
  }
}

std::vector<std::string> compiled_isas() { return {PAGEDLLM_VEC_NAME}; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sgmv_add_", &sgmv_add_, "y[t, slice j] += (x[t] @ A[s, j, :r]^T) @ B_j[s, :r] for s = row_slots[t] >= 0",
        py::arg("y"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"), py::arg("ranks"), py::arg("row_slots"));
  m.def("compiled_isas", &compiled_isas, "the vector code path compiled in: avx512, avx2 or portable");
}
