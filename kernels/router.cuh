// The fused router scores (router.cu), called by ops.cpp. x [..., d] bf16 or fp32, contiguous;
// w [heads, d] and b [heads] fp32; s, ds [..., heads] fp32 contiguous.
#pragma once
#include <ATen/ATen.h>

#include <string>

namespace attnsweep {

// Why the kernels cannot take x (bf16 or fp32) and w (at most 16 heads, W within shared
// memory, x in aligned 16-byte chunks), or empty where they can; ops.cpp runs the ATen form
// otherwise.
std::string cuda_router_misfit(const at::Tensor& x, const at::Tensor& w);
// s = sigmoid(x w^T + b); b may be null.
void cuda_router_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor* b, at::Tensor& s);
// dx (x's dtype), dw [heads, d] and db [heads] (fp32) from ds and the forward's s.
void cuda_router_backward(const at::Tensor& ds, const at::Tensor& s, const at::Tensor& x, const at::Tensor& w,
                          at::Tensor& dx, at::Tensor& dw, at::Tensor& db);

}  // namespace attnsweep
