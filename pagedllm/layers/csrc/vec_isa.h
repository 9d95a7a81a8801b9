// Which of ATen's vector implementations (at::vec::Vectorized) a CPU extension compiles: the widest
// set -march=native allows (AVX-512: 16 float32 lanes, AVX2: 8, else ATen's portable loops).
// Include before any ATen header; PAGEDLLM_VEC_NAME names the choice (for compiled_isas()).
// Shared by csrc/fused_ops.cpp and lora/csrc/sgmv.cpp.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__FMA__)
#define CPU_CAPABILITY_AVX512 1
#define CPU_CAPABILITY AVX512
#define PAGEDLLM_VEC_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2 1
#define CPU_CAPABILITY AVX2
#define PAGEDLLM_VEC_NAME "avx2"
#else
#define CPU_CAPABILITY DEFAULT
#define PAGEDLLM_VEC_NAME "portable"
#endif
