// The head transpose with the optional rotary embedding (rope.cu), called by ops.cpp.
// to_heads: src [B, L, H, D], dst [B, H, L, D]; else the reverse. Both contiguous, bf16 or
// fp32 alike. cos, sin: [L, D] contiguous, fp32 or the tensors' dtype, or both null for no
// rotation; transposed: the rotation's transpose (the backward's).
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

void cuda_heads(const at::Tensor& src, const at::Tensor* cos, const at::Tensor* sin, bool to_heads, bool transposed,
                at::Tensor& dst);

}  // namespace attnsweep
