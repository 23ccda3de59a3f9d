// The offset part of PPA attention: query i also attends the keys i - d for the offsets d of
// S_p beyond the window (an ascending list, offsets[j] >= window). The window part runs on the
// window kernels; ops.cpp merges the two parts by their log-sum-exps, and the backward of each
// part uses the merged lse and delta, so each computes exactly its own pairs' gradients.
//
// S_p is sparse and irregular (about L^p offsets, gaps growing like d^(1-p)): a tile of
// queries shares almost no keys across offsets, so matrix units would multiply mostly masked
// entries. These kernels do one (query, key) pair per step instead, one warp per query (per
// key in dK/dV), the head dimension spread over the lanes: the work is the number of pairs,
// which grows like L^(1+p), and every key row a warp reads is one contiguous load.

#include "ppa.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

namespace attnsweep {
namespace {

constexpr int WARPS = 8;
constexpr int U = 4;  // offsets per step: their loads and reductions overlap
constexpr float LOG2E = 1.4426950408889634f;

// Sums each of n values over the warp, the n reductions interleaved.
template <int N>
__device__ __forceinline__ void warp_sums(float* v) {
#pragma unroll
    for (int o = 16; o; o >>= 1)
#pragma unroll
        for (int u = 0; u < N; ++u) v[u] += __shfl_xor_sync(0xffffffffu, v[u], o);
}

// The E = D / 32 consecutive elements of a row this lane owns, as floats.
template <int E>
__device__ __forceinline__ void load(const __nv_bfloat16* row, int lane, float* out) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(row + lane * E);
#pragma unroll
    for (int e = 0; e < E / 2; ++e) {
        const float2 f = __bfloat1622float2(p[e]);
        out[2 * e] = f.x;
        out[2 * e + 1] = f.y;
    }
}

template <int E>
__device__ __forceinline__ float dot(const float* a, const float* b) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) s += a[e] * b[e];
    return s;
}

// Offsets that query i reaches: offsets[0 .. n) with offsets[j] <= i.
__device__ __forceinline__ int reach(const int* offsets, int n, int i) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (offsets[mid] <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// A query row (b, h, i) of q: its position and its KV head's key and value rows.
struct QueryRow {
    int i;
    const __nv_bfloat16 *k, *v;
};

template <int D>
__device__ __forceinline__ QueryRow query_row(const PpaArgs& a, int64_t row) {
    const int64_t bh = row / a.len;
    const int64_t kv = (bh / a.heads) * a.kv_heads + (bh % a.heads) / (a.heads / a.kv_heads);
    return {(int)(row % a.len), a.k + kv * a.len * D, a.v + kv * a.len * D};
}

// The key and value rows i - offsets[j + u], u < U, this lane's part of each; steps past
// the n-th offset repeat offset j (their scores are then discarded).
template <int D, int E>
__device__ __forceinline__ void load_offset_rows(const QueryRow& r, const int* offsets, int j, int n, int lane,
                                                 float (*kr)[E], float (*vr)[E]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int key = r.i - offsets[j + u < n ? j + u : j];
        load<E>(r.k + (int64_t)key * D, lane, kr[u]);
        load<E>(r.v + (int64_t)key * D, lane, vr[u]);
    }
}

// Forward: o [B, H, L, D] (fp32, normalised) and lse [B, H, L] over the offset keys only
// (-inf and zeros for a query no offset reaches).
template <int D>
__global__ void __launch_bounds__(WARPS * 32) ppa_forward(PpaArgs a, float* __restrict__ o, float* __restrict__ lse) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;  // (b, h, i)
    if (row >= (int64_t)a.batch * a.heads * a.len) return;
    const QueryRow r = query_row<D>(a, row);
    const int i = r.i;
    float q[E], acc[E] = {};
    load<E>(a.q + row * D, lane, q);
    const float scale = a.scale * LOG2E;  // scores in base 2
    float m = -INFINITY, l = 0.f;
    const int n = reach(a.offsets, a.n_offsets, i);
    for (int j = 0; j < n; j += U) {
        // Past the last offset, a step repeats offset j with a score of -inf.
        float kr[U][E], vr[U][E], s[U];
        load_offset_rows<D, E>(r, a.offsets, j, n, lane, kr, vr);
#pragma unroll
        for (int u = 0; u < U; ++u) s[u] = dot<E>(q, kr[u]);
        warp_sums<U>(s);
        float mx = m;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            s[u] = j + u < n ? s[u] * scale : -INFINITY;
            mx = fmaxf(mx, s[u]);
        }
        const float corr = exp2f(m - mx);
        l *= corr;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] *= corr;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float p = exp2f(s[u] - mx);
            l += p;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] += p * vr[u][e];
        }
        m = mx;
    }
    const float inv = n ? 1.f / l : 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[row * D + lane * E + e] = acc[e] * inv;
    if (lane == 0) lse[row] = n ? (m + log2f(l)) / LOG2E : -INFINITY;
}

// dQ of the offset pairs: dq_i = scale sum_j dS_ij k_(i - d_j), dS = P (dP - delta),
// P = exp(s - lse) with the merged lse.
template <int D>
__global__ void __launch_bounds__(WARPS * 32) ppa_dq(PpaArgs a, PpaGrad g, float* __restrict__ dq) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= (int64_t)a.batch * a.heads * a.len) return;
    const QueryRow r = query_row<D>(a, row);
    const int i = r.i;
    float q[E], go[E], acc[E] = {};
    load<E>(a.q + row * D, lane, q);
    load<E>(g.dout + row * D, lane, go);
    const float lse = g.lse[row], delta = g.delta[row];
    const int n = reach(a.offsets, a.n_offsets, i);
    for (int j = 0; j < n; j += U) {
        float kr[U][E], vr[U][E], sp[2 * U];  // sp: U scores, then U values of dP
        load_offset_rows<D, E>(r, a.offsets, j, n, lane, kr, vr);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            sp[u] = dot<E>(q, kr[u]);
            sp[U + u] = dot<E>(go, vr[u]);
        }
        warp_sums<2 * U>(sp);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float ds = j + u < n ? __expf(sp[u] * a.scale - lse) * (sp[U + u] - delta) : 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] += ds * kr[u][e];
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) dq[row * D + lane * E + e] = acc[e] * a.scale;
}

// dK and dV of the offset pairs, one warp per key m of a KV head, over the query heads of its
// group: the queries that reach m are i = m + d_j.
template <int D>
__global__ void __launch_bounds__(WARPS * 32) ppa_dkdv(PpaArgs a, PpaGrad g, float* __restrict__ dk, float* __restrict__ dv) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;  // (b, kv head, m)
    if (row >= (int64_t)a.batch * a.kv_heads * a.len) return;
    const int m = row % a.len;
    const int64_t bkv = row / a.len;
    const int group = a.heads / a.kv_heads;
    float kr[E], vr[E], gk[E] = {}, gv[E] = {};
    load<E>(a.k + row * D, lane, kr);
    load<E>(a.v + row * D, lane, vr);
    const int n = reach(a.offsets, a.n_offsets, a.len - 1 - m);
    for (int h = 0; h < group; ++h) {
        const int64_t bh = (bkv / a.kv_heads) * a.heads + (bkv % a.kv_heads) * group + h;
        for (int j = 0; j < n; j += U) {
            float q[U][E], go[U][E], sp[2 * U];  // sp: U scores, then U values of dP
            int64_t qrow[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                qrow[u] = bh * a.len + m + a.offsets[j + u < n ? j + u : j];
                load<E>(a.q + qrow[u] * D, lane, q[u]);
                load<E>(g.dout + qrow[u] * D, lane, go[u]);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                sp[u] = dot<E>(q[u], kr);
                sp[U + u] = dot<E>(go[u], vr);
            }
            warp_sums<2 * U>(sp);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float p = j + u < n ? __expf(sp[u] * a.scale - g.lse[qrow[u]]) : 0.f;
                const float ds = p * (sp[U + u] - g.delta[qrow[u]]);
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    gv[e] += p * go[u][e];
                    gk[e] += ds * q[u][e];
                }
            }
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {
        dk[row * D + lane * E + e] = gk[e] * a.scale;
        dv[row * D + lane * E + e] = gv[e];
    }
}

PpaArgs args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets) {
    return {reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()),
            reinterpret_cast<const __nv_bfloat16*>(k.data_ptr()),
            reinterpret_cast<const __nv_bfloat16*>(v.data_ptr()),
            offsets.data_ptr<int>(),
            (int)offsets.numel(),
            (int)q.size(0),
            (int)q.size(1),
            (int)k.size(1),
            (int)q.size(2),
            (float)(1.0 / std::sqrt((double)q.size(3)))};
}

int blocks(int64_t rows) { return (int)((rows + WARPS - 1) / WARPS); }

}  // namespace

void ppa_offsets_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                         at::Tensor& o, at::Tensor& lse) {
    const c10::cuda::CUDAGuard guard(q.device());
    const auto a = args(q, k, v, offsets);
    const int64_t rows = (int64_t)a.batch * a.heads * a.len;
    if (rows == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    if (q.size(3) == 64)
        ppa_forward<64><<<blocks(rows), WARPS * 32, 0, stream>>>(a, o.data_ptr<float>(), lse.data_ptr<float>());
    else
        ppa_forward<128><<<blocks(rows), WARPS * 32, 0, stream>>>(a, o.data_ptr<float>(), lse.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ppa_offsets_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                          const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq,
                          at::Tensor& dk, at::Tensor& dv) {
    const c10::cuda::CUDAGuard guard(q.device());
    const auto a = args(q, k, v, offsets);
    const PpaGrad g{reinterpret_cast<const __nv_bfloat16*>(dout.data_ptr()), lse.data_ptr<float>(),
                    delta.data_ptr<float>()};
    const int64_t qrows = (int64_t)a.batch * a.heads * a.len, krows = (int64_t)a.batch * a.kv_heads * a.len;
    if (qrows == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    if (q.size(3) == 64) {
        ppa_dq<64><<<blocks(qrows), WARPS * 32, 0, stream>>>(a, g, dq.data_ptr<float>());
        ppa_dkdv<64><<<blocks(krows), WARPS * 32, 0, stream>>>(a, g, dk.data_ptr<float>(), dv.data_ptr<float>());
    } else {
        ppa_dq<128><<<blocks(qrows), WARPS * 32, 0, stream>>>(a, g, dq.data_ptr<float>());
        ppa_dkdv<128><<<blocks(krows), WARPS * 32, 0, stream>>>(a, g, dk.data_ptr<float>(), dv.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attnsweep
