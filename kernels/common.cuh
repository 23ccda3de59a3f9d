// Device helpers shared by the mma.sync kernels (attention.cu), the wgmma kernels
// (attention_sm90.cu) and the fused element-wise kernels.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

namespace attnsweep {
namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// A bf16 or fp32 value as fp32 (the fused element-wise kernels take either dtype).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Whether query position pos sees key (pos < 0 marks a row without a query).
__device__ __forceinline__ bool visible(int key, int pos, int window, int len) {
    return pos >= 0 && key <= pos && pos - key < window && key < len;
}

// A block whose query rows [row0, row0 + rows) all lie past the active count still gives them
// defined outputs: zeros in out (D columns a row), and lse -inf where lse is given.
template <int D>
__device__ void zero_rows(__nv_bfloat16* out, float* lse, int64_t qbase, int row0, int rows, int lq) {
    for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
        const int r = row0 + i / D;
        if (r < lq) out[(qbase + r) * D + i % D] = __float2bfloat16(0.f);
    }
    if (lse)
        for (int i = threadIdx.x; i < rows; i += blockDim.x)
            if (row0 + i < lq) lse[qbase + row0 + i] = -INFINITY;
}

// First index of an ascending query list whose position is >= key (binary search); the dense
// list (qpos null) holds every position.
__device__ __forceinline__ int first_at_or_after(const int* qpos, int64_t base, int n, int key) {
    if (!qpos) return min(max(key, 0), n);
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (qpos[base + mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

}  // namespace
}  // namespace attnsweep
