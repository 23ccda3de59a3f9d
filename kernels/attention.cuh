// Launchers of the CUDA attention kernels (attention.cu), called by the autograd layer in
// ops.cpp. Tensors: q [B, H, Lq, D], k and v [B, Hkv, L, D], all bf16 and contiguous;
// qpos [B, H, Lq] int32 ascending positions and nq [B, H] int32 counts, or null for the dense
// case (query r at position r, all Lq active); lse, delta [B, H, Lq] fp32.
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

// What every kernel knows of a call: the query list (qpos, nq; null for the dense case) and
// the shapes.
struct ListShape {
    const int *qpos, *nq;
    int heads, kv_heads, lq, len, window;
    float scale;  // softmax scale, 1/sqrt(D)
};

ListShape list_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor* qpos, const at::Tensor* nq,
                     int64_t window);

void cuda_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* qpos,
                  const at::Tensor* nq, int64_t window, at::Tensor& out, at::Tensor& lse);

// The forward on Hopper's wgmma (attention_sm90.cu); same contract as cuda_forward, which
// calls it on compute capability 9.0 in libraries built for sm_90a.
void sm90_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* qpos,
                  const at::Tensor* nq, int64_t window, at::Tensor& out, at::Tensor& lse);

// dQ, and dK with dV, of the backward on Hopper's wgmma (attention_sm90.cu); cuda_backward
// calls them where cuda_forward calls sm90_forward.
void sm90_dq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* qpos, const at::Tensor* nq,
             int64_t window, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq);
void sm90_dkdv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* qpos,
               const at::Tensor* nq, int64_t window, const at::Tensor& lse, const at::Tensor& delta,
               const at::Tensor& dout, at::Tensor& dk, at::Tensor& dv);

void cuda_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* qpos,
                   const at::Tensor* nq, int64_t window, const at::Tensor& lse, const at::Tensor& delta,
                   const at::Tensor& dout, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

}  // namespace attnsweep
