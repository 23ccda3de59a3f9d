// The head transpose between a projection's layout x [B, L, H, D] and attention's
// [B, H, L, D], both ways, optionally with the rotary position embedding in the "rotate half"
// layout where dimension c pairs with c + D/2:
//   y[c]       = x[c] cos[c]       - x[c + D/2] sin[c]
//   y[c + D/2] = x[c + D/2] cos[c + D/2] + x[c] sin[c + D/2]
// computed in fp32, rounded once. The backward of a move is the move the other way, with the
// transposed rotation. Unfused, the rotation is a copy for the transpose, the concatenation of
// the rotated halves, a negation, two products and a sum, each a pass over q or k; and ATen's
// copy of a transposed view (v going in, the output coming out) moves two bytes at a time.

#include "rope.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

namespace attnsweep {
namespace {

constexpr int THREADS = 256;

enum Rotation { NONE, FORWARD, TRANSPOSED };

// The [B, L, H, D] side's shape.
struct Shape {
    int64_t b, l, h, d;
};

// N elements through 16-byte moves where they fill whole ones (the host then checked the
// alignment), else one by one.
template <int N, typename T>
__device__ __forceinline__ void move(T* __restrict__ dst, const T* __restrict__ src) {
    if constexpr (N * sizeof(T) % 16 == 0) {
#pragma unroll
        for (int k = 0; k < (int)(N * sizeof(T) / 16); ++k)
            reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) dst[k] = src[k];
    }
}

// One chunk of V elements of a row's first half and its partner in the second, from `in` to
// `out` (both already at the chunk), rotated by the angles at `cos` and `sin` (already at the
// row's position and the chunk) unless R is NONE.
template <typename T, typename A, int V, Rotation R>
__device__ __forceinline__ void move_pair(const T* __restrict__ in, const A* __restrict__ cos,
                                          const A* __restrict__ sin, uint32_t half, T* __restrict__ out) {
    alignas(16) T x[V], z[V];
    move<V>(x, in);
    move<V>(z, in + half);
    if constexpr (R != NONE) {
        alignas(16) A c0[V], c1[V], s0[V], s1[V];
        move<V>(c0, cos);
        move<V>(c1, cos + half);
        move<V>(s0, sin);
        move<V>(s1, sin + half);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float a = to_float(x[k]), e = to_float(z[k]);
            if (R == FORWARD) {
                x[k] = static_cast<T>(a * to_float(c0[k]) - e * to_float(s0[k]));
                z[k] = static_cast<T>(e * to_float(c1[k]) + a * to_float(s1[k]));
            } else {
                x[k] = static_cast<T>(a * to_float(c0[k]) + e * to_float(s1[k]));
                z[k] = static_cast<T>(e * to_float(c1[k]) - a * to_float(s0[k]));
            }
        }
    }
    move<V>(out, x);
    move<V>(out + half, z);
}

// One thread per (b, l, h) row and chunk of V elements of the row's first half, with the
// matching chunk of its second half: the pair the rotation mixes. TO_HEADS: src [B, L, H, D],
// dst [B, H, L, D]; else the reverse. Angles A: fp32, or T as the model keeps them.
// Indices in 32 bits: the host checked that the threads fit.
template <typename T, typename A, int V, Rotation R>
__global__ void heads_kernel(const T* __restrict__ src, const A* __restrict__ cos, const A* __restrict__ sin,
                             Shape s, bool to_heads, T* __restrict__ dst) {
    const uint32_t half = s.d / 2, chunks = half / V, h = s.h, l = s.l;
    const uint32_t i = blockIdx.x * THREADS + threadIdx.x;
    if (i >= s.b * s.l * s.h * chunks) return;
    const uint32_t row = i / chunks, c = (i - row * chunks) * V;  // row: (b, l, h) in [B, L, H] order
    const uint32_t bl = row / h, head = row - bl * h, b = bl / l, pos = bl - b * l;
    const int64_t blhd = int64_t(row) * s.d, bhld = ((int64_t(b) * h + head) * l + pos) * s.d;
    const T* in = src + (to_heads ? blhd : bhld);
    T* out = dst + (to_heads ? bhld : blhd);
    // Without a rotation there are no angles (null), and no pointer is formed from them.
    const int64_t angle = int64_t(pos) * s.d + c;
    move_pair<T, A, V, R>(in + c, R == NONE ? cos : cos + angle, R == NONE ? sin : sin + angle, half, out + c);
}

// One decoding step (a single position): thread i takes (row b, head j of qkv's H + 2 Hkv, a
// chunk of V elements of the first half with its partner in the second). Query heads go to q
// rotated, key heads rotated and value heads as they are to the cache's entry e, which the host
// reads nowhere: it and the position come from the device, so a captured step replays.
template <typename A, int V>
__global__ void step_kernel(const __nv_bfloat16* __restrict__ qkv, const A* __restrict__ cos,
                            const A* __restrict__ sin, const int64_t* __restrict__ entry,
                            const int64_t* __restrict__ pos, uint32_t rows, uint32_t heads, uint32_t kv_heads,
                            uint32_t d, int64_t slots, __nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ kc,
                            __nv_bfloat16* __restrict__ vc, int64_t* __restrict__ kpos) {
    using T = __nv_bfloat16;
    const uint32_t half = d / 2, chunks = half / V, per_row = heads + 2 * kv_heads;
    const uint32_t i = blockIdx.x * THREADS + threadIdx.x;
    if (i >= rows * per_row * chunks) return;
    const uint32_t row = i / chunks, c = (i - row * chunks) * V;  // row: (b, j) in [B, H + 2 Hkv] order
    const uint32_t b = row / per_row, j = row - b * per_row;
    const int64_t e = entry[0];
    if (i == 0) kpos[e] = pos[0];
    T* out;
    if (j < heads)
        out = q + (int64_t(b) * heads + j) * d;
    else if (j < heads + kv_heads)
        out = kc + ((int64_t(b) * kv_heads + (j - heads)) * slots + e) * d;
    else
        out = vc + ((int64_t(b) * kv_heads + (j - heads - kv_heads)) * slots + e) * d;
    const T* in = qkv + int64_t(row) * d + c;
    // Query and key heads rotate; value heads move as they are.
    if (j < heads + kv_heads)
        move_pair<T, A, V, FORWARD>(in, cos + c, sin + c, half, out + c);
    else
        move_pair<T, A, V, NONE>(in, cos + c, sin + c, half, out + c);
}

// Calls f(A{}) with A the angles' element type: fp32, or the moved tensor's T.
template <typename T, typename F>
void by_angle(const at::Tensor* cos, F f) {
    if (!cos || cos->scalar_type() != at::kFloat)
        f(T{});
    else
        f(float{});
}

bool aligned16(const at::Tensor* x) { return !x || reinterpret_cast<uintptr_t>(x->data_ptr()) % 16 == 0; }

}  // namespace

void cuda_heads(const at::Tensor& src, const at::Tensor* cos, const at::Tensor* sin, bool to_heads, bool transposed,
                at::Tensor& dst) {
    const c10::cuda::CUDAGuard guard(src.device());
    const auto& blhd = to_heads ? src : dst;
    const Shape s{blhd.size(0), blhd.size(1), blhd.size(2), blhd.size(3)};
    if (src.numel() == 0) return;
    TORCH_CHECK(s.b * s.l * s.h * (s.d / 2) < (int64_t(1) << 31), "head transpose: tensor too large");
    const bool vector = aligned16(&src) && aligned16(&dst) && aligned16(cos) && aligned16(sin);
    auto stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(src, [&](auto t) {
        using T = decltype(t);
        by_angle<T>(cos, [&](auto a) {
            using A = decltype(a);
            auto run = [&](auto v, auto r) {
                constexpr int V = decltype(v)::value;
                const int64_t n = s.b * s.l * s.h * (s.d / 2 / V);
                heads_kernel<T, A, V, decltype(r)::value><<<(n + THREADS - 1) / THREADS, THREADS, 0, stream>>>(
                    static_cast<const T*>(src.data_ptr()), cos ? static_cast<const A*>(cos->data_ptr()) : nullptr,
                    sin ? static_cast<const A*>(sin->data_ptr()) : nullptr, s, to_heads,
                    static_cast<T*>(dst.data_ptr()));
            };
            auto by_rotation = [&](auto v) {
                if (!cos)
                    run(v, std::integral_constant<Rotation, NONE>{});
                else if (transposed)
                    run(v, std::integral_constant<Rotation, TRANSPOSED>{});
                else
                    run(v, std::integral_constant<Rotation, FORWARD>{});
            };
            constexpr int V = 16 / sizeof(T);
            if (vector && (s.d / 2) % V == 0)
                by_rotation(std::integral_constant<int, V>{});
            else
                by_rotation(std::integral_constant<int, 1>{});
        });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cuda_decode_step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& entry,
                      const at::Tensor& pos, int64_t heads, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& kpos, const at::Tensor& q) {
    const c10::cuda::CUDAGuard guard(qkv.device());
    const int64_t rows = k.size(0), kv = k.size(1), slots = k.size(2), d = k.size(3);
    TORCH_CHECK(rows * (heads + 2 * kv) * (d / 2) < (int64_t(1) << 31), "decode step: tensor too large");
    const bool vector = aligned16(&qkv) && aligned16(&k) && aligned16(&v) && aligned16(&q) && aligned16(&cos) &&
                        aligned16(&sin);
    auto stream = at::cuda::getCurrentCUDAStream();
    using T = __nv_bfloat16;
    by_angle<T>(&cos, [&](auto a) {
        using A = decltype(a);
        auto run = [&](auto v_) {
            constexpr int V = decltype(v_)::value;
            const int64_t n = rows * (heads + 2 * kv) * (d / 2 / V);
            step_kernel<A, V><<<(n + THREADS - 1) / THREADS, THREADS, 0, stream>>>(
                static_cast<const T*>(qkv.data_ptr()), static_cast<const A*>(cos.data_ptr()),
                static_cast<const A*>(sin.data_ptr()), entry.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                (uint32_t)rows, (uint32_t)heads, (uint32_t)kv, (uint32_t)d, slots, static_cast<T*>(q.data_ptr()),
                static_cast<T*>(k.data_ptr()), static_cast<T*>(v.data_ptr()), kpos.data_ptr<int64_t>());
        };
        // 16-byte moves (two for fp32 angles) where every row, half and chunk starts aligned.
        constexpr int V = 8;
        if (vector && (d / 2) % V == 0)
            run(std::integral_constant<int, V>{});
        else
            run(std::integral_constant<int, 1>{});
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attnsweep
