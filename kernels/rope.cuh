// The fused rotary embedding (rope.cu), called by ops.cpp. x, dx: [B, L, H, D]; y, dy:
// [B, H, L, D]; all contiguous, bf16 or fp32 alike; cos, sin: [L, D] fp32.
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

void cuda_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y);
void cuda_rope_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& dx);

}  // namespace attnsweep
