// Single-query attention over a decoding cache, split over the keys (flash-decoding): a block
// takes one KV head of one row and a run of cache entries, each of its warps U entries at a
// time for every query head of the group (GQA reads each key once), with an online softmax;
// a second kernel combines the runs by their log-sum-exp. Every entry's position is read
// first, so entries the query does not see (outside a window, PPA's gaps, empty ones) cost 8
// bytes, not a key. Positions come from the device: the launch is the same at every step, so
// a captured decoding step replays it. The reference (ops.cpp, decode_reference) computes the
// same softmax with ATen.

#include "decode.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <c10/cuda/CUDAGuard.h>

namespace attnsweep {
namespace {

constexpr int WARPS = 4;
// Entries a warp loads at once.
constexpr int U = 4;
// Entries a block takes at least: fewer leave its warps too little to stream.
constexpr int MIN_RUN = 64;

struct DecodeArgs {
    const __nv_bfloat16 *q, *k, *v;
    const int64_t *kpos, *qpos;
    const bool* near;
    int64_t near_len, window, sinks;
    int heads, kv_heads, slots, run, splits;
    float scale_log2;  // softmax scale times log2(e): scores in the exp2 domain
    float *part_out, *part_lse;
};

// D / 32 values of a row per lane: lane l holds elements [l * E, l * E + E).
template <int E>
__device__ __forceinline__ void load_row(const __nv_bfloat16* row, int lane, float* x) {
    const __nv_bfloat16* p = row + lane * E;
    if constexpr (E == 2) {
        const __nv_bfloat162 t = *reinterpret_cast<const __nv_bfloat162*>(p);
        x[0] = __low2float(t), x[1] = __high2float(t);
    } else {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
        const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
        x[0] = __low2float(a), x[1] = __high2float(a), x[2] = __low2float(b), x[3] = __high2float(b);
    }
}

template <int D, int G>
__global__ void __launch_bounds__(WARPS * 32) decode_split_kernel(DecodeArgs a) {
    constexpr int E = D / 32;
    const int bk = blockIdx.x, split = blockIdx.y;  // bk = b * kv_heads + kvh
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = bk / a.kv_heads, kvh = bk % a.kv_heads;
    const int64_t qp = a.qpos[0];
    float q[G][E], acc[G][E], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int h = kvh * G + g;
        load_row<E>(a.q + ((int64_t)b * a.heads + h) * D, lane, q[g]);
#pragma unroll
        for (int e = 0; e < E; ++e) q[g][e] *= a.scale_log2, acc[g][e] = 0.f;
        m[g] = -INFINITY, l[g] = 0.f;
    }
    const int64_t base = (int64_t)bk * a.slots * D;
    const int lo = split * a.run, hi = min(a.slots, lo + a.run);
    // U consecutive entries a warp at a time: their positions, keys and values are all loaded
    // before any is used, so a warp has U loads in flight, not one.
    for (int j0 = lo + warp * U; j0 < hi; j0 += WARPS * U) {
        bool seen[U];
        float kx[U][E], vx[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u;
            const int64_t p = j < hi ? a.kpos[j] : -1;
            const int64_t d = qp - p;
            seen[u] = p >= 0 && d >= 0 &&
                      (a.window < 0 || d < a.window || p < a.sinks ||
                       (a.near && a.near[d < a.near_len ? d : a.near_len - 1]));
        }
        // Without PPA's table nearly every entry a slot holds is seen (a window's ring, the whole
        // prefix): the keys and values load beside the positions, one round trip, not two.
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (j0 + u < hi && (seen[u] || !a.near)) {
                load_row<E>(a.k + base + (int64_t)(j0 + u) * D, lane, kx[u]);
                load_row<E>(a.v + base + (int64_t)(j0 + u) * D, lane, vx[u]);
            }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float s[U];
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u] = 0.f;
                if (seen[u]) {
#pragma unroll
                    for (int e = 0; e < E; ++e) s[u] += q[g][e] * kx[u][e];
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u] = seen[u] ? warp_sum(s[u]) : -INFINITY;
                mx = fmaxf(mx, s[u]);
            }
            if (mx == -INFINITY) continue;
            const float c = exp2f(m[g] - mx);
            l[g] *= c;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= c;
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (seen[u]) {
                    const float w = exp2f(s[u] - mx);
                    l[g] += w;
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[g][e] += w * vx[u][e];
                }
            m[g] = mx;
        }
    }
    // The warps' runs combined in shared memory, then one partial result per query head.
    __shared__ float sm[WARPS][G], sl[WARPS][G], sacc[WARPS][G][D];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) sm[warp][g] = m[g], sl[warp][g] = l[g];
#pragma unroll
        for (int e = 0; e < E; ++e) sacc[warp][g][lane * E + e] = acc[g][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, c = i % D;
        float mx = -INFINITY;
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm[w][g]);
        float sum = 0.f, o = 0.f;
        if (mx > -INFINITY)
            for (int w = 0; w < WARPS; ++w) {
                const float f = exp2f(sm[w][g] - mx);
                sum += sl[w][g] * f, o += sacc[w][g][c] * f;
            }
        const int64_t row = ((int64_t)b * a.heads + kvh * G + g) * a.splits + split;
        a.part_out[row * D + c] = sum > 0.f ? o / sum : 0.f;
        if (c == 0) a.part_lse[row] = sum > 0.f ? mx + log2f(sum) : -INFINITY;
    }
}

// out[b, h] = the splits' results weighted by exp2(lse_split - lse): the weights computed once
// into shared memory, each thread summing one column over the splits.
constexpr int COMBINE_THREADS = 128;
constexpr int MAX_SPLITS = 1024;

template <int D>
__global__ void __launch_bounds__(COMBINE_THREADS)
    decode_combine_kernel(const float* part_out, const float* part_lse, int splits, __nv_bfloat16* out) {
    __shared__ float w[MAX_SPLITS];
    __shared__ float red[COMBINE_THREADS];
    const int64_t bh = blockIdx.x;
    const float* lse = part_lse + bh * splits;
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += COMBINE_THREADS) mx = fmaxf(mx, lse[s]);
    red[threadIdx.x] = mx;
    __syncthreads();
    for (int half = COMBINE_THREADS / 2; half; half /= 2) {
        if (threadIdx.x < half) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + half]);
        __syncthreads();
    }
    mx = red[0];
    for (int s = threadIdx.x; s < splits; s += COMBINE_THREADS)
        w[s] = mx > -INFINITY ? exp2f(lse[s] - mx) : 0.f;
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += COMBINE_THREADS) {
        float sum = 0.f, o = 0.f;
        const float* col = part_out + bh * splits * D + c;
#pragma unroll 8
        for (int s = 0; s < splits; ++s) sum += w[s], o += w[s] * col[(int64_t)s * D];
        out[bh * D + c] = __float2bfloat16(sum > 0.f ? o / sum : 0.f);
    }
}

template <int D, int G>
void launch(const DecodeArgs& a, int rows, __nv_bfloat16* out, cudaStream_t stream) {
    decode_split_kernel<D, G><<<dim3(rows * a.kv_heads, a.splits), WARPS * 32, 0, stream>>>(a);
    decode_combine_kernel<D><<<rows * a.heads, COMBINE_THREADS, 0, stream>>>(a.part_out, a.part_lse, a.splits, out);
}

template <int D>
void by_group(const DecodeArgs& a, int rows, int group, __nv_bfloat16* out, cudaStream_t stream) {
    switch (group) {
        case 1: return launch<D, 1>(a, rows, out, stream);
        case 2: return launch<D, 2>(a, rows, out, stream);
        case 3: return launch<D, 3>(a, rows, out, stream);
        case 4: return launch<D, 4>(a, rows, out, stream);
        case 5: return launch<D, 5>(a, rows, out, stream);
        case 6: return launch<D, 6>(a, rows, out, stream);
        case 7: return launch<D, 7>(a, rows, out, stream);
        case 8: return launch<D, 8>(a, rows, out, stream);
        default: TORCH_CHECK(false, "the decode kernel takes 1 to 8 query heads per KV head, not ", group);
    }
}

}  // namespace

void cuda_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kpos,
                           const at::Tensor& qpos, int64_t window, int64_t sinks, const at::Tensor* near,
                           at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(q.device());
    const int rows = (int)q.size(0), heads = (int)q.size(1), kv_heads = (int)k.size(1), slots = (int)k.size(2);
    const int dim = (int)q.size(3);
    // Enough runs to fill the GPU a few times over, none shorter than MIN_RUN entries: a shape
    // fixed by the cache, so every step launches the same grid.
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int want = std::max(1, 8 * sms / std::max(1, rows * kv_heads));
    const int run = std::max({MIN_RUN, (slots + want - 1) / want, (slots + MAX_SPLITS - 1) / MAX_SPLITS});
    const int splits = (slots + run - 1) / run;
    auto part_out = at::empty({rows, heads, splits, dim}, q.options().dtype(at::kFloat));
    auto part_lse = at::empty({rows, heads, splits}, q.options().dtype(at::kFloat));
    DecodeArgs a{reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()),
                 reinterpret_cast<const __nv_bfloat16*>(k.data_ptr()),
                 reinterpret_cast<const __nv_bfloat16*>(v.data_ptr()),
                 kpos.data_ptr<int64_t>(),
                 qpos.data_ptr<int64_t>(),
                 near ? near->data_ptr<bool>() : nullptr,
                 near ? near->numel() : 0,
                 window,
                 sinks,
                 heads,
                 kv_heads,
                 slots,
                 run,
                 splits,
                 (float)(1.4426950408889634 / std::sqrt((double)dim)),
                 part_out.data_ptr<float>(),
                 part_lse.data_ptr<float>()};
    auto* o = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    const auto stream = at::cuda::getCurrentCUDAStream();
    if (dim == 64)
        by_group<64>(a, rows, heads / kv_heads, o, stream);
    else
        by_group<128>(a, rows, heads / kv_heads, o, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attnsweep
