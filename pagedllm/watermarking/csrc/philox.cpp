// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC 2011) over a whole vocabulary per context: the
// C++ form of pagedllm/watermarking/philox.py's PhiloxPRF.vocab_uniform (same bits; the Python
// docstring has the construction). Each (row, group g) encrypts the counter (g, s0, s1, s2) under
// the row's key (k0 ^ s3, k1 ^ TOKEN_DOMAIN) and writes the uniforms of tokens 4g .. 4g+3:
// ((word >> 8) + 1) / (2**24 + 1), computed in double and rounded to float as the torch path does.
// The 10 rounds stay in registers; rows x groups are split across OpenMP threads.

#include <ATen/core/Tensor.h>
#include "cpu_tensor.h"  // empty / zeros without <ATen/ops/*.h>
#include <torch/csrc/utils/pybind.h>  // bindings; not <torch/extension.h>: docs/benchmarks.md, "Building the C++ kernels"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
constexpr float kMaxNoise = 17.0f;  // > -log(-log(1 - 2^-24)) = 16.64, the largest noise

inline float word_to_uniform(uint32_t w) {
  return static_cast<float>((static_cast<double>(w >> 8) + 1.0) / 16777217.0);
}

// The four output words of group g of a row whose context state is s[0..3].
inline void philox_group(uint32_t g, const uint32_t* s, uint32_t key0, uint32_t key1, uint32_t* out) {
  uint32_t c0 = g, c1 = s[0], c2 = s[1], c3 = s[2];
  uint32_t k0 = key0 ^ s[3], k1 = key1;
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += kW0;
      k1 += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0, p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

std::vector<uint32_t> state_words(const at::Tensor& state) {
  TORCH_CHECK(state.dim() == 2 && state.size(1) == 4 && state.scalar_type() == at::kLong,
              "state must be [N, 4] int64");
  auto st = state.contiguous();
  std::vector<uint32_t> words(st.numel());
  const int64_t* s = st.data_ptr<int64_t>();
  for (int64_t i = 0; i < st.numel(); ++i) words[i] = static_cast<uint32_t>(s[i]);
  return words;
}

}  // namespace

// state: [N, 4] int64 (the context state's 32-bit words); key0, key1: the token key's two words
// before the per-row XOR (k0, k1 ^ TOKEN_DOMAIN). Returns [N, vocab_size] float32.
at::Tensor philox_vocab_uniform(at::Tensor state, int64_t key0, int64_t key1, int64_t vocab_size) {
  TORCH_CHECK(vocab_size >= 1, "vocab_size must be >= 1");
  const std::vector<uint32_t> s = state_words(state);
  const int64_t n = state.size(0);
  const int64_t groups = (vocab_size + 3) / 4;
  auto out = cpu_tensor::empty({n, groups * 4}, at::kFloat);
  float* o = out.data_ptr<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t w[4];
      philox_group(static_cast<uint32_t>(g), &s[r * 4], static_cast<uint32_t>(key0), static_cast<uint32_t>(key1), w);
      float* dst = o + (r * groups + g) * 4;
      for (int j = 0; j < 4; ++j) dst[j] = word_to_uniform(w[j]);
    }
  }
  return out.narrow(1, 0, vocab_size);
}

// The Gumbel-max draw in one pass: per row, argmax over tokens of logits + (-log(-log(u))), u the
// row's uniforms as above (float32 noise; the first maximum on ties, as torch.argmax). logits:
// [N, V] float32. Returns [N] int64. Rows x chunks of groups run in parallel, each keeping its
// best; the chunks are then reduced in order. The noise is at most kMaxNoise (u <= 1 - 2^-24 gives
// 16.64), so a token whose logit + kMaxNoise cannot beat the chunk's best skips its two logs (and
// a group of four such tokens its encryption): exact, and most of a language model's vocabulary.
at::Tensor philox_gumbel_argmax(at::Tensor state, int64_t key0, int64_t key1, at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be [N, V] float32");
  TORCH_CHECK(state.size(0) == logits.size(0), "state and logits must have the same rows");
  const std::vector<uint32_t> s = state_words(state);
  auto lg = logits.contiguous();
  const float* l = lg.data_ptr<float>();
  const int64_t n = lg.size(0), vocab = lg.size(1);
  const int64_t groups = (vocab + 3) / 4;
  constexpr int64_t kChunk = 4096;  // groups per task
  const int64_t chunks = (groups + kChunk - 1) / kChunk;
  std::vector<float> best_val(n * chunks, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> best_idx(n * chunks, -1);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      float bv = -std::numeric_limits<float>::infinity();
      int64_t bi = -1;
      const float* row = l + r * vocab;
      const int64_t g_end = std::min(groups, (c + 1) * kChunk);
      for (int64_t g = c * kChunk; g < g_end; ++g) {
        const int64_t t_end = std::min<int64_t>(g * 4 + 4, vocab);
        if (bi >= 0) {  // can any of the group's tokens beat the best?
          float top = row[g * 4];
          for (int64_t t = g * 4 + 1; t < t_end; ++t) top = std::max(top, row[t]);
          if (!(top + kMaxNoise > bv)) continue;
        }
        uint32_t w[4];
        philox_group(static_cast<uint32_t>(g), &s[r * 4], static_cast<uint32_t>(key0), static_cast<uint32_t>(key1), w);
        for (int j = 0; j < 4; ++j) {
          const int64_t t = g * 4 + j;
          if (t >= vocab) break;
          if (bi >= 0 && !(row[t] + kMaxNoise > bv)) continue;
          const float v = row[t] + (-std::log(-std::log(word_to_uniform(w[j]))));
          if (bi < 0 || v > bv) {
            bv = v;
            bi = t;
          }
        }
      }
      best_val[r * chunks + c] = bv;
      best_idx[r * chunks + c] = bi;
    }
  }
  auto out = cpu_tensor::empty({n}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    float bv = best_val[r * chunks];
    int64_t bi = best_idx[r * chunks];
    for (int64_t c = 1; c < chunks; ++c) {
      if (best_val[r * chunks + c] > bv) {
        bv = best_val[r * chunks + c];
        bi = best_idx[r * chunks + c];
      }
    }
    o[r] = bi;
  }
  return out;
}

std::vector<std::string> compiled_isas() { return {"portable"}; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("philox_vocab_uniform", &philox_vocab_uniform,
        "[N, V] float32 Philox4x32-10 uniforms of every token per context state",
        py::arg("state"), py::arg("key0"), py::arg("key1"), py::arg("vocab_size"));
  m.def("philox_gumbel_argmax", &philox_gumbel_argmax,
        "[N] int64 argmax of logits + Gumbel noise from the Philox uniforms of each context state",
        py::arg("state"), py::arg("key0"), py::arg("key1"), py::arg("logits"));
  m.def("compiled_isas", &compiled_isas, "the code paths compiled in");
}
