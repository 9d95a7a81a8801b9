// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC 2011) over a whole vocabulary per context: the
// C++ form of pagedllm/watermarking/philox.py's PhiloxPRF.vocab_uniform (same bits; the Python
// docstring has the construction). Each (row, group g) encrypts the counter (g, s0, s1, s2) under
// the row's key (k0 ^ s3, k1 ^ TOKEN_DOMAIN) and writes the uniforms of tokens 4g .. 4g+3:
// ((word >> 8) + 1) / (2**24 + 1), computed in double and rounded to float as the torch path does.
// The 10 rounds stay in registers; rows x groups are split across OpenMP threads.

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

inline float word_to_uniform(uint32_t w) {
  return static_cast<float>((static_cast<double>(w >> 8) + 1.0) / 16777217.0);
}

}  // namespace

// state: [N, 4] int64 (the context state's 32-bit words); key0, key1: the token key's two words
// before the per-row XOR (k0, k1 ^ TOKEN_DOMAIN). Returns [N, vocab_size] float32.
torch::Tensor philox_vocab_uniform(torch::Tensor state, int64_t key0, int64_t key1, int64_t vocab_size) {
  TORCH_CHECK(state.dim() == 2 && state.size(1) == 4 && state.scalar_type() == torch::kInt64,
              "state must be [N, 4] int64");
  TORCH_CHECK(vocab_size >= 1, "vocab_size must be >= 1");
  auto st = state.contiguous();
  const int64_t n = st.size(0);
  const int64_t groups = (vocab_size + 3) / 4;
  auto out = torch::empty({n, groups * 4}, torch::dtype(torch::kFloat32));
  const int64_t* s = st.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint32_t s0 = static_cast<uint32_t>(s[r * 4 + 0]), s1 = static_cast<uint32_t>(s[r * 4 + 1]);
      const uint32_t s2 = static_cast<uint32_t>(s[r * 4 + 2]), s3 = static_cast<uint32_t>(s[r * 4 + 3]);
      uint32_t c0 = static_cast<uint32_t>(g), c1 = s0, c2 = s1, c3 = s2;
      uint32_t k0 = static_cast<uint32_t>(key0) ^ s3, k1 = static_cast<uint32_t>(key1);
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
      float* dst = o + r * groups * 4 + g * 4;
      dst[0] = word_to_uniform(c0);
      dst[1] = word_to_uniform(c1);
      dst[2] = word_to_uniform(c2);
      dst[3] = word_to_uniform(c3);
    }
  }
  return out.narrow(1, 0, vocab_size);
}

std::vector<std::string> compiled_isas() { return {"portable"}; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("philox_vocab_uniform", &philox_vocab_uniform,
        "[N, V] float32 Philox4x32-10 uniforms of every token per context state",
        py::arg("state"), py::arg("key0"), py::arg("key1"), py::arg("vocab_size"));
  m.def("compiled_isas", &compiled_isas, "the code paths compiled in");
}
