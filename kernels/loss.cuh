// The fused cross-entropy (loss.cu), called by ops.cpp. x: [N, V] logits (bf16 or fp32,
// contiguous), y: [N] int64 targets; nll, lse, g: [N] fp32; dx like x.
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

void cuda_cross_entropy(const at::Tensor& x, const at::Tensor& y, at::Tensor& nll, at::Tensor& lse);
void cuda_cross_entropy_backward(const at::Tensor& x, const at::Tensor& y, const at::Tensor& lse, const at::Tensor& g,
                                 at::Tensor& dx);

}  // namespace attnsweep
