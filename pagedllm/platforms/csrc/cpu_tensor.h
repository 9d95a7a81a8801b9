// New CPU tensors for the C++ extensions, without the <ATen/ops/*.h> operator headers.
//
// at::empty / at::empty_like / at::zeros come with the dispatcher's operator headers, whose
// parsing was about half of every extension's compile time (philox.cpp: 19.8 s -> 8.2 s without
// them; docs/benchmarks.md, "Building the C++ kernels"). These allocate through
// at::detail::empty_cpu (<ATen/EmptyTensor.h>), the CPU allocation at::empty itself ends in.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <cstring>
#include <optional>

namespace cpu_tensor {

// A new contiguous CPU tensor of `sizes` (elements per dimension) and `dtype`, uninitialised.
inline at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, /*memory_format_opt=*/std::nullopt);
}

// empty() of `like`'s sizes and dtype (contiguous: callers check that `like` is).
inline at::Tensor empty_like(const at::Tensor& like) { return empty(like.sizes(), like.scalar_type()); }

// empty(), every byte zero.
inline at::Tensor zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  at::Tensor out = empty(sizes, dtype);
  if (out.nbytes() > 0) std::memset(out.data_ptr(), 0, out.nbytes());
  return out;
}

}  // namespace cpu_tensor
