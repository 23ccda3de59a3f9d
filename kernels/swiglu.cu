// The MLP's gate, y = silu(g) u with silu(g) = g sigmoid(g), and its backward
//   du = dy silu(g),   dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g))),
// computed in fp32 and rounded once per output. Unfused, ATen runs silu and a product
// forward, and two products and silu's backward, each a pass over [tokens, intermediate].

#include "swiglu.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace attnsweep {
namespace {

constexpr int THREADS = 256;

// One 16-byte load of each input a thread (8 bf16 or 4 fp32 elements), as ATen's vectorised
// element-wise kernels do; the last thread of a size that is not a multiple takes its few
// elements one by one. Forward: out = y. BACKWARD: out = dg, du too. The inputs' element i
// sits at i for tensors of their own; JOINED, at (i / width) stride + i % width, rows of
// `width` values `stride` apart for the halves of one joined projection (the host checked
// that a row holds whole 16-byte loads there). A template flag, so that training's kernels,
// which never read joined rows, pay no 64-bit division and remainder a thread.
template <typename T, bool BACKWARD, bool JOINED>
__global__ void swiglu_kernel(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ dy, int64_t n,
                              int64_t width, int64_t stride, T* __restrict__ out, T* __restrict__ du) {
    constexpr int V = 16 / sizeof(T);
    const int64_t i0 = (blockIdx.x * (int64_t)THREADS + threadIdx.x) * V;
    if (i0 >= n) return;
    const int64_t at = JOINED ? (i0 / width) * stride + i0 % width : i0;
    const int m = n - i0 < V ? (int)(n - i0) : V;
    alignas(16) T a[V] = {}, b[V] = {}, d[V] = {}, r[V], q[V];
    if (m == V) {
        *reinterpret_cast<uint4*>(a) = *reinterpret_cast<const uint4*>(g + at);
        *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(u + at);
        if (BACKWARD) *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(dy + i0);
    } else {
        // Unrolled with constant indices, so the arrays stay in registers.
#pragma unroll
        for (int k = 0; k < V; ++k)
            if (k < m) a[k] = g[at + k], b[k] = u[at + k], d[k] = BACKWARD ? dy[i0 + k] : T{};
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const float x = to_float(a[k]), s = 1.f / (1.f + __expf(-x));
        if (BACKWARD) {
            const float e = to_float(d[k]);
            r[k] = static_cast<T>(e * to_float(b[k]) * s * (1.f + x * (1.f - s)));
            q[k] = static_cast<T>(e * x * s);
        } else {
            r[k] = static_cast<T>(x * s * to_float(b[k]));
        }
    }
    if (m == V) {
        *reinterpret_cast<uint4*>(out + i0) = *reinterpret_cast<const uint4*>(r);
        if (BACKWARD) *reinterpret_cast<uint4*>(du + i0) = *reinterpret_cast<const uint4*>(q);
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            if (k >= m) break;
            out[i0 + k] = r[k];
            if (BACKWARD) du[i0 + k] = q[k];
        }
    }
}

// g and u hold n = out.numel() values, element i at i, or JOINED at (i / width) stride + i % width.
template <bool BACKWARD, bool JOINED>
void launch(const at::Tensor& g, const at::Tensor& u, const at::Tensor* dy, int64_t width, int64_t stride,
            at::Tensor& out, at::Tensor* du) {
    const c10::cuda::CUDAGuard guard(g.device());
    const int64_t n = out.numel();
    if (n == 0) return;
    check_aligned16("SwiGLU", {&g, &u, dy, &out, du});
    dispatch_float(g, [&](auto t) {
        using T = decltype(t);
        constexpr int64_t v = 16 / sizeof(T);
        TORCH_CHECK(!JOINED || (width % v == 0 && stride % v == 0), "SwiGLU: rows of whole 16-byte loads");
        const int64_t blocks = ((n + v - 1) / v + THREADS - 1) / THREADS;
        swiglu_kernel<T, BACKWARD, JOINED><<<blocks, THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
            static_cast<const T*>(g.data_ptr()), static_cast<const T*>(u.data_ptr()),
            dy ? static_cast<const T*>(dy->data_ptr()) : nullptr, n, width, stride, static_cast<T*>(out.data_ptr()),
            du ? static_cast<T*>(du->data_ptr()) : nullptr);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void cuda_swiglu(const at::Tensor& g, const at::Tensor& u, at::Tensor& y) {
    launch<false, false>(g, u, nullptr, 0, 0, y, nullptr);
}

void cuda_swiglu_joined(const at::Tensor& gu, at::Tensor& y) {
    const int64_t f = y.size(-1);
    // The up half starts f values into each row: its pointer is the gate's, moved on.
    const at::Tensor u = gu.narrow(-1, f, f);
    launch<false, true>(gu, u, nullptr, f, 2 * f, y, nullptr);
}

void cuda_swiglu_backward(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg,
                          at::Tensor& du) {
    launch<true, false>(g, u, &dy, 0, 0, dg, &du);
}

}  // namespace attnsweep
