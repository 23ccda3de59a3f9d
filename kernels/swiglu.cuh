// The fused SwiGLU gate (swiglu.cu), called by ops.cpp. g, u, y, dy, dg, du: one shape,
// contiguous, bf16 or fp32 alike.
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

void cuda_swiglu(const at::Tensor& g, const at::Tensor& u, at::Tensor& y);
// Inference's gate from one joined projection: gu [..., 2F] contiguous (the gate's F values,
// then the up projection's, in each row) to y [..., F].
void cuda_swiglu_joined(const at::Tensor& gu, at::Tensor& y);
void cuda_swiglu_backward(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg,
                          at::Tensor& du);

}  // namespace attnsweep
