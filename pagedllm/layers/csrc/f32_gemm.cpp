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

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include "f32_gemm.h"
#include "linear_bias.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

// w [N, K] float32 -> [ceil(N / 16), K, 16] float32 (the header's layout; zero outputs pad).
// One pass, threads over blocks: each block's 16 rows are written into its [K][16] slab (64 KiB
// at K = 1024, in L2 while written); a model's start packs every linear layer this way.
at::Tensor pack_f32_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.dtype() == at::kFloat, "w must be a float32 [N, K] tensor");
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  auto packed = cpu_tensor::empty({blocks, k, kBlock}, w.scalar_type());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* slab = dst + b * k * kBlock;
      const int64_t rows = std::min<int64_t>(kBlock, n - b * kBlock);
      for (int64_t j = 0; j < kBlock; ++j) {
        const float* row = j < rows ? src + (b * kBlock + j) * k : nullptr;
        for (int64_t c = 0; c < k; ++c) slab[c * kBlock + j] = row ? row[c] : 0.0f;
      }
    }
  });
  return packed;
}

#if PAGEDLLM_F32_GEMM
namespace {

// All rows x all blocks with T-block x MaxR-row tiles. Each thread takes a contiguous range of
// tiles (one stream through the packed weight).
template <int T, int MaxR>
void run_tiles(int64_t m, int64_t k, int64_t blocks, const float* xp, const float* wp, int64_t n, const float* bptr,
               float* yp) {
  const int64_t tiles = (blocks + T - 1) / T;
  at::parallel_for(0, tiles, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) run_tile<T, MaxR>(m, xp, k, wp, T * p, blocks, n, bptr, yp, n);
  });
}

}  // namespace
#endif

// x [M, K] float32 (contiguous), packed from pack_f32_weight(w [N, K]), bias [N] float32 or None
// -> y [M, N] float32 = x w^T (+ bias), see the header.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.dtype() == at::kFloat,
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.dtype() == at::kFloat && packed.is_contiguous() &&
                  packed.size(0) == (n + kBlock - 1) / kBlock && packed.size(1) == k && packed.size(2) == kBlock,
              "packed must come from pack_f32_weight of a [", n, ", ", k, "] weight");
  at::Tensor bias_kept;
  const float* bptr = pagedllm_linear::bias_pointer(bias, n, bias_kept);
  auto y = cpu_tensor::empty({m, n}, x.scalar_type());
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_f32_weight", &pack_f32_weight, "w [N, K] float32 -> packed [ceil(N/16), K, 16] float32");
  m.def("f32_linear", &f32_linear, "x [M, K] float32 @ packed^T (+ bias) -> [M, N] float32");
  m.def("compiled_isas", &compiled_isas, "code paths compiled in");
}
