// Rotary position embedding fused with the head transpose: x [B, L, H, D] (the projection's
// output as laid out) to y [B, H, L, D] (as attention reads it), in the "rotate half"
// layout where dimension c pairs with c + D/2:
//   y[c]       = x[c] cos[c]       - x[c + D/2] sin[c]
//   y[c + D/2] = x[c + D/2] cos[c + D/2] + x[c] sin[c + D/2]
// computed in fp32, rounded once. The backward is the transposed rotation, back to x's
// layout. Unfused, this is a copy for the transpose, the concatenation of the rotated
// halves, a negation, two products and a sum, each a pass over q or k.

#include "rope.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

namespace attnsweep {
namespace {

constexpr int THREADS = 256;

struct Shape {
    int64_t b, l, h, d;
};

// One thread per (b, l, h, c < D/2). BACKWARD: src is dy [B, H, L, D], dst dx [B, L, H, D],
// the rotation transposed (sin negated).
template <typename T, bool BACKWARD>
__global__ void rope_kernel(const T* __restrict__ src, const float* __restrict__ cos, const float* __restrict__ sin,
                            Shape s, T* __restrict__ dst) {
    const int64_t half = s.d / 2;
    const int64_t i = blockIdx.x * (int64_t)THREADS + threadIdx.x;
    if (i >= s.b * s.l * s.h * half) return;
    const int64_t c = i % half, h = (i / half) % s.h, l = (i / (half * s.h)) % s.l, b = i / (half * s.h * s.l);
    const int64_t blhd = ((b * s.l + l) * s.h + h) * s.d, bhld = ((b * s.h + h) * s.l + l) * s.d;
    const float c0 = cos[l * s.d + c], c1 = cos[l * s.d + c + half];
    const float s0 = sin[l * s.d + c], s1 = sin[l * s.d + c + half];
    const int64_t in = BACKWARD ? bhld : blhd, out = BACKWARD ? blhd : bhld;
    const float a = to_float(src[in + c]), z = to_float(src[in + c + half]);
    if (BACKWARD) {
        dst[out + c] = static_cast<T>(a * c0 + z * s1);
        dst[out + c + half] = static_cast<T>(z * c1 - a * s0);
    } else {
        dst[out + c] = static_cast<T>(a * c0 - z * s0);
        dst[out + c + half] = static_cast<T>(z * c1 + a * s1);
    }
}

template <bool BACKWARD>
void launch(const at::Tensor& src, const at::Tensor& cos, const at::Tensor& sin, Shape s, at::Tensor& dst) {
    const c10::cuda::CUDAGuard guard(src.device());
    const int64_t n = s.b * s.l * s.h * (s.d / 2);
    if (n == 0) return;
    const auto blocks = (n + THREADS - 1) / THREADS;
    auto stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(src, [&](auto t) {
        using T = decltype(t);
        rope_kernel<T, BACKWARD><<<blocks, THREADS, 0, stream>>>(static_cast<const T*>(src.data_ptr()),
                                                                 cos.data_ptr<float>(), sin.data_ptr<float>(), s,
                                                                 static_cast<T*>(dst.data_ptr()));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void cuda_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y) {
    launch<false>(x, cos, sin, {x.size(0), x.size(1), x.size(2), x.size(3)}, y);
}

void cuda_rope_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& dx) {
    launch<true>(dy, cos, sin, {dx.size(0), dx.size(1), dx.size(2), dx.size(3)}, dx);
}

}  // namespace attnsweep
