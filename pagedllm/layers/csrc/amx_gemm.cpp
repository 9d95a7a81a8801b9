// bfloat16 GEMM on Intel AMX tiles (tdpbf16ps), batch-invariant by construction.
//
//   y[m, n] = bf16( sum_k x[m, k] * w[n, k]  (+ bias[n]) ),   x, w bfloat16, sums in float32
//
// Why: oneDNN's AMX kernels are fast at prefill row counts but a row's result depends on the
// batch (their blocking changes with M, issue 29), and our AVX-512 BF16 GEMM (bf16_gemm.cpp)
// leaves the tile unit idle. This kernel keeps one order of the float32 additions for every M.
//
// Arithmetic and batch invariance: a C tile (16 rows x 16 outputs, float32) starts at zero and
// takes tdpbf16ps of the K / 32 chunks in ascending k, always (no split-K, no other kernel for
// some M). x is read as 16-row A tiles (the last one zero-padded, always 16 rows configured), so
// row m's sum is the same instruction sequence on the same data at any M and beside any rows:
// the row groups, output blocks and threads only decide *which* tile a row and an output fall
// in. The bias (float32) is added after the K sum and the result rounded to bfloat16 to nearest
// even (NaN stays NaN), as bf16_gemm.cpp does. tdpbf16ps treats subnormal inputs as zero and
// flushes subnormal results (Intel SDM, TDPBF16PS); its additions are not in the same order as
// vdpbf16ps's, so this kernel and bf16_gemm.cpp can differ by a bf16 rounding step.
//
// Packed layout (pack_bf16_weight, bf16_pack.h): [N / 16][K / 2][16][2] bfloat16, so K chunk j
// of block b is 16 rows of 64 bytes at b * K * 16 + j * 512 elements: exactly a B tile. Threads
// (at::parallel_for) split pairs of blocks; a micro-kernel call holds 1-2 A tiles (16-32 rows) x
// 1-2 B tiles (16-32 outputs) in 4 C tiles, and prefetches the next pair of blocks while the
// first row group streams the current one (decode reads each weight once from memory).
//
// Tiles need the process's permission (Linux >= 5.16: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA)); amx_ready() asks once and bf16_linear fails with the reason otherwise.
// K must be a multiple of 32 (one A tile row); bf16_linear raises otherwise.

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDLLM_AMX_GEMM 1
#else
#define PAGEDLLM_AMX_GEMM 0
#endif

namespace {

using pagedllm_bf16::check_packed;
using pagedllm_bf16::kBlock;
using pagedllm_bf16::kPair;
using pagedllm_bf16::pack_bf16_weight;
constexpr int64_t kTileRows = 16;   // rows of an A / C tile
constexpr int64_t kTileK = 32;      // bfloat16 columns of an A tile row (64 bytes)
constexpr int64_t kBTile = kTileK / kPair * kPair * kBlock;   // elements of one B tile (16 x 32)

#if PAGEDLLM_AMX_GEMM
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Ask Linux once for the tile data state; the reason in words on failure, "" when granted.
const std::string& amx_permission() {
  static const std::string why = [] {
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: ") + std::strerror(errno);
    return std::string();
  }();
  return why;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: A (x rows), 2-3: B (weight blocks), 4-7: C (float32 sums), all 16 rows x 64 bytes.
void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

inline void store_bf16(c10::BFloat16* out, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));   // RNE; NaN stays NaN
}

// RA A tiles (rows m0 .. m0 + 16 RA of the padded x, row stride k) x TB blocks from block b:
// C = sum over the K / 32 chunks in ascending order, then bias, bf16, masked to the valid
// rows (< m) and outputs (< n).
template <int RA, int TB>
void micro_kernel(const c10::BFloat16* x, int64_t k, int64_t m0, int64_t m, const c10::BFloat16* packed,
                  int64_t b, int64_t blocks, int64_t n, const float* bias, c10::BFloat16* out, bool pf_next) {
  const int64_t chunks = k / kTileK, block_elems = k * kBlock, xstride = k * 2;
  const c10::BFloat16* a0 = x + m0 * k;
  const c10::BFloat16* a1 = a0 + kTileRows * k;
  const c10::BFloat16* b0 = packed + b * block_elems;
  const c10::BFloat16* b1 = b0 + block_elems;
  // the next pair of blocks, at the same offsets: 2 KiB per chunk, all of it by the last chunk
  const char* next = reinterpret_cast<const char*>(packed + (b + TB) * block_elems);
  const bool pf = pf_next && b + TB < blocks;
  const int64_t next_blocks = pf ? std::min<int64_t>(2, blocks - b - TB) : 0;
  _tile_zero(4);
  if constexpr (TB > 1) _tile_zero(5);
  if constexpr (RA > 1) _tile_zero(6);
  if constexpr (RA > 1 && TB > 1) _tile_zero(7);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t nb = 0; nb < next_blocks; ++nb)
      for (int line = 0; line < 16; ++line)
        _mm_prefetch(next + (nb * block_elems + c * kBTile) * 2 + 64 * line, _MM_HINT_T0);
    _tile_loadd(2, b0 + c * kBTile, 64);
    _tile_loadd(0, a0 + c * kTileK, xstride);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (TB > 1) {
      _tile_loadd(3, b1 + c * kBTile, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if constexpr (RA > 1) {
      _tile_loadd(1, a1 + c * kTileK, xstride);
      _tile_dpbf16ps(6, 1, 2);
      if constexpr (TB > 1) _tile_dpbf16ps(7, 1, 3);
    }
  }
  alignas(64) float cbuf[RA * kTileRows][TB * kBlock];
  constexpr int ld = TB * kBlock * sizeof(float);
  _tile_stored(4, &cbuf[0][0], ld);
  if constexpr (TB > 1) _tile_stored(5, &cbuf[0][kBlock], ld);
  if constexpr (RA > 1) _tile_stored(6, &cbuf[kTileRows][0], ld);
  if constexpr (RA > 1 && TB > 1) _tile_stored(7, &cbuf[kTileRows][kBlock], ld);
  const int64_t rows = std::min<int64_t>(RA * kTileRows, m - m0);
  for (int t = 0; t < TB; ++t) {
    const int64_t n0 = (b + t) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, n - n0);
    if (valid <= 0) continue;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r)
      store_bf16(out + (m0 + r) * n + n0, _mm512_add_ps(_mm512_load_ps(&cbuf[r][t * kBlock]), bv), mask);
  }
}

template <int TB>
void rows_kernel(int ra, const c10::BFloat16* x, int64_t k, int64_t m0, int64_t m, const c10::BFloat16* packed,
                 int64_t b, int64_t blocks, int64_t n, const float* bias, c10::BFloat16* out, bool pf_next) {
  if (ra == 2)
    micro_kernel<2, TB>(x, k, m0, m, packed, b, blocks, n, bias, out, pf_next);
  else
    micro_kernel<1, TB>(x, k, m0, m, packed, b, blocks, n, bias, out, pf_next);
}
#endif

}  // namespace

// Whether this process may use the tiles: "" if so, else the reason (not compiled with AMX, or
// the kernel refused the permission). Asks Linux for it on the first call.
std::string amx_unavailable() {
#if PAGEDLLM_AMX_GEMM
  return amx_permission();
#else
  return "built without AMX (needs -mamx-tile -mamx-bf16 and AVX-512 BF16)";
#endif
}

// x [M, K] bfloat16 (contiguous, K a multiple of 32), packed from pack_bf16_weight(w [N, K]),
// bias [N] float32 or None -> y [M, N] bfloat16 = x w^T (+ bias), see the header.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.dtype() == at::kBFloat16,
              "x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  check_packed(packed, n, k);
  TORCH_CHECK(k % kTileK == 0, "the AMX GEMM needs K a multiple of 32, got K=", k);
  at::Tensor bias_kept;
  const float* bptr = pagedllm_linear::bias_pointer(bias, n, bias_kept);
  auto y = cpu_tensor::empty({m, n}, x.scalar_type());
  if (m == 0 || n == 0) return y;
#if PAGEDLLM_AMX_GEMM
  const std::string& why = amx_permission();
  TORCH_CHECK(why.empty(), "the AMX GEMM cannot run: ", why);
  // Whole A tiles: rows past M read zeros (a padded copy when M is not a multiple of 16).
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  at::Tensor xp = x;
  if (m % kTileRows) {
    xp = cpu_tensor::zeros({tiles * kTileRows, k}, x.scalar_type());
    xp.narrow(0, 0, m).copy_(x);
  }
  const c10::BFloat16* xptr = xp.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t blocks = packed.size(0), pairs = (blocks + 1) / 2;
  // Each thread takes a contiguous range of block pairs (one stream through the packed weight);
  // for each pair, the row groups (2 A tiles, the last maybe 1) follow each other.
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    load_tile_config();
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = 2 * p;
      const bool two = b + 2 <= blocks;
      for (int64_t t = 0; t < tiles; t += 2) {
        const int ra = static_cast<int>(std::min<int64_t>(2, tiles - t));
        if (two)
          rows_kernel<2>(ra, xptr, k, t * kTileRows, m, wp, b, blocks, n, bptr, yp, t == 0);
        else
          rows_kernel<1>(ra, xptr, k, t * kTileRows, m, wp, b, blocks, n, bptr, yp, false);   // the last, odd block
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "bf16_linear: ", amx_unavailable());
#endif
  return y;
}

// The code paths compiled in (load_extension's contract).
std::vector<std::string> compiled_isas() {
#if PAGEDLLM_AMX_GEMM
  return {"amx_bf16"};
#else
  return {};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16_weight", &pack_bf16_weight, "w [N, K] bf16 -> packed [N/16, K/2, 32] bf16");
  m.def("bf16_linear", &bf16_linear, "x [M, K] bf16 @ packed^T (+ bias) -> [M, N] bf16 on AMX tiles");
  m.def("amx_unavailable", &amx_unavailable, "'' if this process may use AMX tiles, else why not");
  m.def("compiled_isas", &compiled_isas, "code paths compiled in");
}
