// The offset part of PPA attention (ppa.cu), called by ops.cpp. q [B, H, L, D], k and v
// [B, Hkv, L, D], dout like q, all bf16 and contiguous, D 64 or 128; offsets [J] int32
// ascending, each at least the window and below L; lse, delta [B, H, L] fp32 (the merged
// ones in the backward); o, dq [B, H, L, D] and dk, dv [B, Hkv, L, D] fp32.
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>

namespace attnsweep {

struct PpaArgs {
    const __nv_bfloat16 *q, *k, *v;
    const int* offsets;
    int n_offsets, batch, heads, kv_heads, len;
    float scale;  // 1/sqrt(D)
};

struct PpaGrad {
    const __nv_bfloat16* dout;
    const float *lse, *delta;
};

void ppa_offsets_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                         at::Tensor& o, at::Tensor& lse);
void ppa_offsets_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                          const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq,
                          at::Tensor& dk, at::Tensor& dv);

}  // namespace attnsweep
