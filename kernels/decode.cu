// Single-query attention over a decoding cache, split over the keys (flash-decoding): a block
// takes one KV head of one row and a run of cache entries; its threads work in groups of D / 8
// lanes, each lane 8 elements (16 bytes) of an entry, so a warp reads 32 / (D / 8) entries at
// once and each group U entries ahead, for every query head of the GQA group (each key read
// once), with an online softmax per group; the groups' results are combined in shared memory
// and a second kernel combines the runs by their log-sum-exp. Entries the query does not see
// (outside a window, PPA's gaps, empty ones) are skipped after their position is read: where no
// PPA table decides, the keys load beside their positions, one round trip, not two. Positions
// come from the device: the launch is the same at every step, so a captured decoding step
// replays it. The reference (ops.cpp, decode_reference) computes the same softmax with ATen.

#include "decode.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <c10/cuda/CUDAGuard.h>

namespace attnsweep {
namespace {

constexpr int WARPS = 4;
// Entries a block takes at least: fewer leave its groups too little to stream.
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

// Eight bf16 (16 bytes, aligned) as fp32.
__device__ __forceinline__ void unpack8(const uint4& raw, float* x) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(p[i]);
        x[2 * i] = f.x, x[2 * i + 1] = f.y;
    }
}

template <int D, int G>
__global__ void __launch_bounds__(WARPS * 32) decode_split_kernel(DecodeArgs a) {
    constexpr int LPE = D / 8;             // lanes an entry takes
    constexpr int EPW = 32 / LPE;          // entries a warp reads at once: its groups
    constexpr int GROUPS = WARPS * EPW;    // independent online softmaxes in a block
    constexpr int U = G > 4 ? 2 : 4;       // entries a group loads ahead (registers bound it)
    const int bk = blockIdx.x, split = blockIdx.y;  // bk = b * kv_heads + kvh
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = threadIdx.x / LPE, sub = lane % LPE;
    const int b = bk / a.kv_heads, kvh = bk % a.kv_heads;
    const int64_t qp = a.qpos[0];
    float q[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int h = kvh * G + g;
        unpack8(*reinterpret_cast<const uint4*>(a.q + ((int64_t)b * a.heads + h) * D + sub * 8), q[g]);
#pragma unroll
        for (int e = 0; e < 8; ++e) q[g][e] *= a.scale_log2, acc[g][e] = 0.f;
        m[g] = -INFINITY, l[g] = 0.f;
    }
    const int64_t base = (int64_t)bk * a.slots * D + sub * 8;
    const int lo = split * a.run, hi = min(a.slots, lo + a.run);
    // The loop runs alike for every lane of a warp (its bound is the warp's first entry), so
    // the shuffles inside see every lane; entries past the run are not seen.
    for (int w0 = lo + warp * EPW * U; w0 < hi; w0 += GROUPS * U) {
        const int j0 = w0 + (lane / LPE) * U;
        bool seen[U];
        uint4 kr[U], vr[U];
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
        // prefix): the loads do not wait for the positions.
#pragma unroll
        for (int u = 0; u < U; ++u) {
            kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
            if (j0 + u < hi && (!a.near || seen[u])) {
                kr[u] = *reinterpret_cast<const uint4*>(a.k + base + (int64_t)(j0 + u) * D);
                vr[u] = *reinterpret_cast<const uint4*>(a.v + base + (int64_t)(j0 + u) * D);
            }
        }
        // Every score first (the shuffles need the whole warp), then the softmax per group.
        float s[G][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kx[8];
            unpack8(kr[u], kx);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float t = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) t += q[g][e] * kx[e];
#pragma unroll
                for (int o = LPE / 2; o; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
                s[g][u] = seen[u] ? t : -INFINITY;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[g][u]);
            if (mx == -INFINITY) continue;
            const float c = exp2f(m[g] - mx);
            l[g] *= c;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= c;
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (seen[u]) {
                    const float w = exp2f(s[g][u] - mx);
                    float vx[8];
                    unpack8(vr[u], vx);
                    l[g] += w;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] += w * vx[e];
                }
            m[g] = mx;
        }
    }
    // The groups' runs combined in shared memory, then one partial result per query head.
    __shared__ float sm[GROUPS][G], sl[GROUPS][G], sacc[GROUPS][G][D];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (sub == 0) sm[group][g] = m[g], sl[group][g] = l[g];
#pragma unroll
        for (int e = 0; e < 8; ++e) sacc[group][g][sub * 8 + e] = acc[g][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, c = i % D;
        float mx = -INFINITY;
        for (int w = 0; w < GROUPS; ++w) mx = fmaxf(mx, sm[w][g]);
        float sum = 0.f, o = 0.f;
        if (mx > -INFINITY)
            for (int w = 0; w < GROUPS; ++w) {
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
    // Each lane loads 16 bytes of a row: rows start 16-byte aligned where the tensors do.
    check_aligned16("decode attention", {&q, &k, &v});
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
