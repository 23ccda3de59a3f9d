// The fused RMSNorm (norm.cu), called by ops.cpp. x, dy, y, dx: [..., d] contiguous, bf16 or
// fp32 (all alike); w, dw: [d] fp32; rstd: one fp32 per row.
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

// The widest d the kernels take (wider rows take the ATen formulas, on the GPU too).
int64_t cuda_norm_max_dim();
void cuda_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y, at::Tensor& rstd);
// The residual add with the norm after it: h = x + r, y = RMSNorm(h) (x, r, h, y alike).
void cuda_add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps, at::Tensor& h,
                       at::Tensor& y, at::Tensor& rstd);
// dres (null, or like dy): a gradient added to dx, the stream's own past a fused add.
void cuda_rms_norm_backward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy, const at::Tensor& rstd,
                            const at::Tensor* dres, at::Tensor& dx, at::Tensor& dw);

}  // namespace attnsweep
