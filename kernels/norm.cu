// RMSNorm over the last dimension, one warp per row, in fp32 whatever the input dtype (as
// Hugging Face's LlamaRMSNorm computes it):
//   r = rsqrt(mean(x^2) + eps),  n = x r,  y = w n                       (y in x's dtype)
//   dx = r (g - n mean(g n)) with g = w dy,   dw = sum over rows of dy n
// Unfused, the fp32 upcast and each of these products is a pass over the activations, in
// the forward and again in the backward. dw is summed per block and the blocks' partial
// sums are added after, so the result does not depend on scheduling.
//
// The backward keeps each thread's share of dw in registers: a warp per row holds at most
// 32 * MAXC columns (d <= 1024, the models this was written for). Wider rows (hidden sizes of
// 1-8B models, OLMo-2's norm over all query heads) take a whole block per row, each thread
// C columns, with the row's dot product summed across the block.

#include "norm.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <tuple>
#include <type_traits>

namespace attnsweep {
namespace {

constexpr int WARPS = 8;
constexpr int BLOCKS = 264;  // two per H100 multiprocessor; rows are strided over them

// ADD: the residual add before the norm, in the same pass (training's rows): h = x + r rounded
// to T as the unfused add rounds it, the norm computed from that rounded h; each lane reads
// back only the h it wrote.
template <typename T, bool ADD>
__global__ void norm_forward(const T* __restrict__ x, const T* __restrict__ r, const float* __restrict__ w,
                             int64_t rows, int d, float eps, T* __restrict__ h, T* __restrict__ y,
                             float* __restrict__ rstd) {
    const int lane = threadIdx.x % 32;
    for (int64_t row = blockIdx.x * WARPS + threadIdx.x / 32; row < rows; row += (int64_t)gridDim.x * WARPS) {
        const int64_t at = row * d;
        const T* xr = ADD ? h + at : x + at;
        float ss = 0.f;
        for (int j = lane; j < d; j += 32) {
            T s = x[at + j];
            if (ADD) h[at + j] = s = static_cast<T>(to_float(s) + to_float(r[at + j]));
            const float v = to_float(s);
            ss += v * v;
        }
        const float rs = rsqrtf(warp_sum(ss) / d + eps);
        for (int j = lane; j < d; j += 32) y[at + j] = static_cast<T>(w[j] * (to_float(xr[j]) * rs));
        if (lane == 0) rstd[row] = rs;
    }
}

// The residual add and the RMSNorm after it for few rows, a block a row (decoding has a row
// per sequence, and a warp a row would leave most of the GPU idle): h = x + r rounded to T as
// the unfused add rounds it, then y = w h rsqrt(mean(h^2) + eps) from that rounded h, as the
// unfused norm reads it. Each thread reads back only the h it wrote.
constexpr int ADD_THREADS = 256;

template <typename T>
__global__ void __launch_bounds__(ADD_THREADS)
    add_norm_forward(const T* __restrict__ x, const T* __restrict__ r, const float* __restrict__ w, int64_t rows,
                     int d, float eps, T* __restrict__ h, T* __restrict__ y, float* __restrict__ rstd) {
    __shared__ float part[ADD_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t at = row * d;
        float ss = 0.f;
        for (int j = threadIdx.x; j < d; j += ADD_THREADS) {
            const T s = static_cast<T>(to_float(x[at + j]) + to_float(r[at + j]));
            h[at + j] = s;
            const float v = to_float(s);
            ss += v * v;
        }
        ss = warp_sum(ss);
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < ADD_THREADS / 32; ++k) total += part[k];
        const float rs = rsqrtf(total / d + eps);
        for (int j = threadIdx.x; j < d; j += ADD_THREADS) y[at + j] = static_cast<T>(w[j] * (to_float(h[at + j]) * rs));
        if (threadIdx.x == 0) rstd[row] = rs;
        // The next row's sums overwrite part only after every thread has read it.
        __syncthreads();
    }
}

// dw partial sums of each block go to partial[blockIdx.x, :] (d <= 32 * MAXC). dres, where not
// null, is the gradient the stream x also receives past the norm (the residual path of a
// fused add): added to dx before its one rounding.
constexpr int MAXC = 32;

template <typename T>
__global__ void norm_backward(const T* __restrict__ x, const float* __restrict__ w, const T* __restrict__ dy,
                              const float* __restrict__ rstd, const T* __restrict__ dres, int64_t rows, int d,
                              T* __restrict__ dx, float* __restrict__ partial) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float acc[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; ++c) acc[c] = 0.f;
    for (int64_t r = blockIdx.x * WARPS + warp; r < rows; r += (int64_t)gridDim.x * WARPS) {
        const T *xr = x + r * d, *gr = dy + r * d;
        const float rs = rstd[r];
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            const int j = lane + 32 * c;
            if (j < d) {
                const float n = to_float(xr[j]) * rs, g = to_float(gr[j]);
                dot += g * w[j] * n;
                acc[c] += g * n;
            }
        }
        const float mean = warp_sum(dot) / d;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            const int j = lane + 32 * c;
            if (j < d) {
                const float n = to_float(xr[j]) * rs;
                const float res = dres ? to_float(dres[r * d + j]) : 0.f;
                dx[r * d + j] = static_cast<T>(rs * (to_float(gr[j]) * w[j] - n * mean) + res);
            }
        }
    }
    __shared__ float sums[WARPS][32 * MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; ++c)
        if (lane + 32 * c < d) sums[warp][lane + 32 * c] = acc[c];
    __syncthreads();
    for (int j = threadIdx.x; j < d; j += WARPS * 32) {
        float s = 0.f;
        for (int k = 0; k < WARPS; ++k) s += sums[k][j];
        partial[blockIdx.x * (int64_t)d + j] = s;
    }
}

// A block per row (rows strided over the blocks), thread t holding columns t + WIDE * c for
// c < C: dw's partial sums stay in registers whatever d (up to WIDE * C).
template <typename T, int WIDE, int C>
__global__ void __launch_bounds__(WIDE)
    norm_backward_wide(const T* __restrict__ x, const float* __restrict__ w, const T* __restrict__ dy,
                       const float* __restrict__ rstd, const T* __restrict__ dres, int64_t rows, int d,
                       T* __restrict__ dx, float* __restrict__ partial) {
    constexpr int NW = WIDE / 32;
    // Two slots, alternating by row: a row's sums are written while the last row's may still
    // be read, so one barrier a row suffices.
    __shared__ float sums[2][NW];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float acc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.f;
    int slot = 0;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, slot ^= 1) {
        const T *xr = x + r * d, *gr = dy + r * d;
        const float rs = rstd[r];
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int j = threadIdx.x + WIDE * c;
            if (j < d) dot += to_float(gr[j]) * w[j] * to_float(xr[j]) * rs;
        }
        dot = warp_sum(dot);
        if (lane == 0) sums[slot][warp] = dot;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < NW; ++k) total += sums[slot][k];
        const float mean = total / d;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int j = threadIdx.x + WIDE * c;
            if (j < d) {
                const float n = to_float(xr[j]) * rs, g = to_float(gr[j]);
                const float res = dres ? to_float(dres[r * d + j]) : 0.f;
                dx[r * d + j] = static_cast<T>(rs * (g * w[j] - n * mean) + res);
                acc[c] += g * n;
            }
        }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int j = threadIdx.x + WIDE * c;
        if (j < d) partial[blockIdx.x * (int64_t)d + j] = acc[c];
    }
}

// Calls f with the block width and columns a thread (as integral constants) that cover d:
// 256 threads up to 16 columns each (d <= 4096), then 1024 threads up to 32 (d <= 32768; 64
// would spill, 1024 threads leaving each 64 registers).
template <typename F>
void by_width(int64_t d, F f) {
    using std::integral_constant;
    if (d <= 256 * 8) f(integral_constant<int, 256>{}, integral_constant<int, 8>{});
    else if (d <= 256 * 16) f(integral_constant<int, 256>{}, integral_constant<int, 16>{});
    else if (d <= 1024 * 8) f(integral_constant<int, 1024>{}, integral_constant<int, 8>{});
    else if (d <= 1024 * 16) f(integral_constant<int, 1024>{}, integral_constant<int, 16>{});
    else f(integral_constant<int, 1024>{}, integral_constant<int, 32>{});  // up to cuda_norm_max_dim
}

// y = RMSNorm(x), or with r: h = x + r and y = RMSNorm(h), rstd per row either way.
void forward(const at::Tensor& x, const at::Tensor* r, const at::Tensor& w, double eps, at::Tensor* h, at::Tensor& y,
             at::Tensor& rstd) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t d = x.size(-1), rows = x.numel() / d;
    if (rows == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(x, [&](auto t) {
        using T = decltype(t);
        const auto* xp = static_cast<const T*>(x.data_ptr());
        const T* rp = r ? static_cast<const T*>(r->data_ptr()) : nullptr;
        T* hp = h ? static_cast<T*>(h->data_ptr()) : nullptr;
        auto* yp = static_cast<T*>(y.data_ptr());
        const float* wp = w.data_ptr<float>();
        float* rs = rstd.data_ptr<float>();
        const int blocks = (int)std::min<int64_t>(BLOCKS * 4, (rows + WARPS - 1) / WARPS);
        auto warp_a_row = [&](auto add) {
            norm_forward<T, decltype(add)::value>
                <<<blocks, WARPS * 32, 0, stream>>>(xp, rp, wp, rows, (int)d, (float)eps, hp, yp, rs);
        };
        if (!r)
            warp_a_row(std::false_type{});
        else if (rows < BLOCKS * WARPS)  // a block a row while rows are too few to fill the GPU a warp a row
            add_norm_forward<T><<<(int)rows, ADD_THREADS, 0, stream>>>(xp, rp, wp, rows, (int)d, (float)eps, hp, yp, rs);
        else
            warp_a_row(std::true_type{});
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int64_t cuda_norm_max_dim() { return 1024 * 32; }

void cuda_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y, at::Tensor& rstd) {
    forward(x, nullptr, w, eps, nullptr, y, rstd);
}

void cuda_add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps, at::Tensor& h,
                       at::Tensor& y, at::Tensor& rstd) {
    forward(x, &r, w, eps, &h, y, rstd);
}

void cuda_rms_norm_backward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy, const at::Tensor& rstd,
                            const at::Tensor* dres, at::Tensor& dx, at::Tensor& dw) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t d = x.size(-1), rows = x.numel() / d;
    const bool narrow = d <= 32 * MAXC;
    // The wide kernel takes a block a row: as many blocks as rows, up to two a multiprocessor.
    const int blocks = (int)std::max<int64_t>(
        1, narrow ? std::min<int64_t>(BLOCKS, (rows + WARPS - 1) / WARPS) : std::min<int64_t>(BLOCKS, rows));
    auto partial = at::zeros({blocks, d}, w.options());
    if (rows > 0) {
        auto stream = at::cuda::getCurrentCUDAStream();
        dispatch_float(x, [&](auto t) {
            using T = decltype(t);
            const auto args = std::make_tuple(static_cast<const T*>(x.data_ptr()), w.data_ptr<float>(),
                                              static_cast<const T*>(dy.data_ptr()), rstd.data_ptr<float>(),
                                              dres ? static_cast<const T*>(dres->data_ptr()) : nullptr, rows, (int)d,
                                              static_cast<T*>(dx.data_ptr()), partial.data_ptr<float>());
            if (narrow)
                std::apply([&](auto... a) { norm_backward<T><<<blocks, WARPS * 32, 0, stream>>>(a...); }, args);
            else
                by_width(d, [&](auto wide, auto c) {
                    std::apply(
                        [&](auto... a) {
                            norm_backward_wide<T, decltype(wide)::value, decltype(c)::value>
                                <<<blocks, decltype(wide)::value, 0, stream>>>(a...);
                        },
                        args);
                });
        });
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    dw = partial.sum(0);
}

}  // namespace attnsweep
