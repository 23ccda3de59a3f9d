// Device helpers shared by the mma.sync kernels (attention.cu), the wgmma kernels
// (attention_sm90.cu) and the fused element-wise kernels.
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "walk.cuh"

namespace attnsweep {
namespace {

// Calls f(T{}) with T the element type of x, __nv_bfloat16 or float: the dtypes the fused
// element-wise kernels take.
template <typename F>
void dispatch_float(const at::Tensor& x, F f) {
    if (x.scalar_type() == at::kBFloat16)
        f(__nv_bfloat16{});
    else if (x.scalar_type() == at::kFloat)
        f(float{});
    else
        TORCH_CHECK(false, "the fused kernels take bf16 or fp32 tensors, not ", x.scalar_type());
}

// The kernels that move 16 bytes a thread need their tensors (those not null) 16-byte aligned.
inline void check_aligned16(const char* what, std::initializer_list<const at::Tensor*> xs) {
    for (const at::Tensor* x : xs)
        TORCH_CHECK(!x || reinterpret_cast<uintptr_t>(x->data_ptr()) % 16 == 0, what,
                    ": tensors must be 16-byte aligned");
}

// Calls f(std::true_type{}) where a call has PPA's far distances (far not null), else
// f(std::false_type{}): the kernels' FAR flag, so those without PPA carry none of its code.
template <typename F>
void by_far(const void* far, F f) {
    if (far) f(std::true_type{});
    else f(std::false_type{});
}

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

// The query tile block index y takes, of `tiles` tiles of `rows` rows: the tiles holding a
// routed list's full-prefix rows (the first `full`) first, highest first, then the others in
// order; a list without them (full < 0), every tile highest first. The longest tiles start in
// the first wave, so they do not trail the grid.
__device__ __forceinline__ int tile_at(int y, int tiles, int full, int rows) {
    const int first = full < 0 ? tiles : (full + rows - 1) / rows;
    return y < first ? first - 1 - y : y;
}

// The query tile a block of the list kernels owns: its (batch, head) `bh` = b * heads + h,
// the KV head its head reads, the list's active rows `nq` and full-prefix rows `full` (-1:
// none), the tile's first row (the `tile`-th of `tiles` in tile_at's order) and where the
// list's rows start in [B * H * Lq].
struct QueryTile {
    int bh, b, h, kvh, nq, full, row0;
    int64_t qbase;
};
template <typename Shape>
__device__ __forceinline__ QueryTile query_tile(const Shape& p, int bh, int tile, int tiles, int rows) {
    const int full = p.nfull ? p.nfull[bh] : -1;
    return QueryTile{bh,
                     bh / p.heads,
                     bh % p.heads,
                     bh % p.heads / (p.heads / p.kv_heads),
                     p.nq ? p.nq[bh] : p.lq,
                     full,
                     tile_at(tile, tiles, full, rows) * rows,
                     (int64_t)bh * p.lq};
}

// A block whose query rows [row0, row0 + rows) all lie past the active count still gives them
// defined outputs: zeros in out (D columns a row, at out_row), and lse -inf where lse is given.
template <int D, typename Shape>
__device__ void zero_rows(const Shape& p, __nv_bfloat16* out, float* lse, int64_t qbase, int row0, int rows) {
    for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
        const int r = row0 + i / D;
        if (r < p.lq) out[out_row(p, qbase, r) * D + i % D] = __float2bfloat16(0.f);
    }
    if (lse)
        for (int i = threadIdx.x; i < rows; i += blockDim.x)
            if (row0 + i < p.lq) lse[qbase + row0 + i] = -INFINITY;
}

// Query positions of a block's `rows` list rows from row0; -1 for rows outside [lo, hi).
template <int rows>
__device__ __forceinline__ void load_positions(int* spos, const int* qpos, int64_t base, int row0, int lo, int hi) {
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        const int r = row0 + i;
        spos[i] = r >= lo && r < hi ? (qpos ? qpos[base + r] : r) : -1;
    }
}

// First index of an ascending query list whose position is >= key (binary search); the dense
// list (qpos null) holds every position, index = position (dense lists have no full-prefix
// group, so their window group starts at index 0).
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
