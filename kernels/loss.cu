// Next-token cross-entropy on logits in their compute dtype (bf16), one block per row:
//   nll[r]      = lse[r] - x[r, y[r]],   lse[r] = log sum_j exp(x[r, j])   (fp32)
//   dx[r, j]    = g[r] (exp(x[r, j] - lse[r]) - [j == y[r]])                (x's dtype)
// The unfused form upcasts the [N, V] logits to fp32 and runs log-softmax, gather and their
// backward over that copy: about ten full passes over a tensor that, at V = 32000 and 32k
// tokens, is 4 GB in fp32. Here the forward reads the logits once and the backward reads
// them once and writes the gradient once.

#include "loss.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <type_traits>

namespace attnsweep {
namespace {

constexpr int THREADS = 512;

// Calls f(j, x[j]) for j in [0, vocab) over the block's threads, eight bf16 at a time (one
// 16-byte load) where the row allows it.
template <typename T, typename F>
__device__ __forceinline__ void visit_row(const T* xr, int64_t vocab, F f) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        if (vocab % 8 == 0 && reinterpret_cast<uintptr_t>(xr) % 16 == 0) {
            for (int64_t j = threadIdx.x * 8; j < vocab; j += THREADS * 8) {
                const uint4 raw = *reinterpret_cast<const uint4*>(xr + j);
                const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
                for (int e = 0; e < 8; ++e) f(j + e, __bfloat162float(v[e]));
            }
            return;
        }
    }
    for (int64_t j = threadIdx.x; j < vocab; j += THREADS) f(j, to_float(xr[j]));
}

// Running (max, sum of exp(x - max)) merged with another.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    if (mx == -INFINITY) return;
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
    m = mx;
}

template <typename T>
__global__ void ce_forward(const T* __restrict__ x, const int64_t* __restrict__ y, int64_t vocab, float* nll,
                           float* lse) {
    const int64_t row = blockIdx.x;
    const T* xr = x + row * vocab;
    float m = -INFINITY, s = 0.f;
    visit_row(xr, vocab, [&](int64_t, float v) {
        if (v > m) {
            s = s * __expf(m - v) + 1.f;
            m = v;
        } else {
            s += __expf(v - m);
        }
    });
    for (int o = 16; o; o >>= 1) merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    __shared__ float ms[THREADS / 32], ss[THREADS / 32];
    if (threadIdx.x % 32 == 0) ms[threadIdx.x / 32] = m, ss[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < THREADS / 32 ? ms[threadIdx.x] : -INFINITY;
        s = threadIdx.x < THREADS / 32 ? ss[threadIdx.x] : 0.f;
        for (int o = 16; o; o >>= 1)
            merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
        if (threadIdx.x == 0) {
            const float l = m + logf(s);
            const int64_t t = y[row];
            lse[row] = l;
            // An out-of-range target gives NaN, which the training loop reports.
            nll[row] = (t >= 0 && t < vocab) ? l - to_float(xr[t]) : NAN;
        }
    }
}

template <typename T>
__global__ void ce_backward(const T* __restrict__ x, const int64_t* __restrict__ y, const float* __restrict__ lse,
                            const float* __restrict__ g, int64_t vocab, T* dx) {
    const int64_t row = blockIdx.x;
    const T* xr = x + row * vocab;
    T* dr = dx + row * vocab;
    const float l = lse[row], gr = g[row];
    const int64_t t = y[row];
    auto grad = [&](int64_t j, float v) { return gr * (__expf(v - l) - (j == t ? 1.f : 0.f)); };
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        // Eight gradients per 16-byte store, as the loads in visit_row.
        if (vocab % 8 == 0 && reinterpret_cast<uintptr_t>(xr) % 16 == 0) {
            for (int64_t j = threadIdx.x * 8; j < vocab; j += THREADS * 8) {
                const uint4 raw = *reinterpret_cast<const uint4*>(xr + j);
                const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
                uint4 out;
                __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __bfloat1622float2(v[e]);
                    o[e] = __floats2bfloat162_rn(grad(j + 2 * e, f.x), grad(j + 2 * e + 1, f.y));
                }
                *reinterpret_cast<uint4*>(dr + j) = out;
            }
            return;
        }
    }
    for (int64_t j = threadIdx.x; j < vocab; j += THREADS) dr[j] = static_cast<T>(grad(j, to_float(xr[j])));
}

}  // namespace

void cuda_cross_entropy(const at::Tensor& x, const at::Tensor& y, at::Tensor& nll, at::Tensor& lse) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0), vocab = x.size(1);
    if (rows == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(x, [&](auto t) {
        using T = decltype(t);
        ce_forward<T><<<rows, THREADS, 0, stream>>>(static_cast<const T*>(x.data_ptr()), y.data_ptr<int64_t>(), vocab,
                                                    nll.data_ptr<float>(), lse.data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cuda_cross_entropy_backward(const at::Tensor& x, const at::Tensor& y, const at::Tensor& lse, const at::Tensor& g,
                                 at::Tensor& dx) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0), vocab = x.size(1);
    if (rows == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(x, [&](auto t) {
        using T = decltype(t);
        ce_backward<T><<<rows, THREADS, 0, stream>>>(static_cast<const T*>(x.data_ptr()), y.data_ptr<int64_t>(),
                                                     lse.data_ptr<float>(), g.data_ptr<float>(), vocab,
                                                     static_cast<T*>(dx.data_ptr()));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attnsweep
