// The head transpose with the optional rotary embedding (rope.cu), called by ops.cpp.
// to_heads: src [B, L, H, D], dst [B, H, L, D]; else the reverse. Both contiguous, bf16 or
// fp32 alike. cos, sin: [L, D] contiguous, fp32 or the tensors' dtype, or both null for no
// rotation; transposed: the rotation's transpose (the backward's).
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

void cuda_heads(const at::Tensor& src, const at::Tensor* cos, const at::Tensor* sin, bool to_heads, bool transposed,
                at::Tensor& dst);

// One decoding step: qkv [B, 1, (H + 2 Hkv) D] bf16 to q [B, H, 1, D] rotated by cos, sin [1, D]
// (bf16 or fp32); the rotated key and the value into entry entry[0] of k, v [B, Hkv, S, D], and
// pos[0] into kpos[entry[0]] (int64, on the device). All contiguous.
void cuda_decode_step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& entry,
                      const at::Tensor& pos, int64_t heads, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& kpos, const at::Tensor& q);

}  // namespace attnsweep
