// Single-query attention over a decoding cache (decode.cu), called by ops.cpp.
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

// q [B, H, 1, D] bf16 (the query of one decoding step per row and head), k, v [B, Hkv, S, D]
// bf16 (a cache slot, every entry written or not), kpos [S] int64 (each entry's position, -1:
// empty), qpos [1] int64 (the query's position, on the device, so a captured step replays at the
// next one). The query sees the entries at positions p <= qpos with d = qpos - p inside its
// window (window < 0: every one), p < sinks, or near[min(d, T - 1)] (near: bool [T], or null).
// out [B, H, 1, D] bf16.
void cuda_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kpos,
                           const at::Tensor& qpos, int64_t window, int64_t sinks, const at::Tensor* near,
                           at::Tensor& out);

}  // namespace attnsweep
