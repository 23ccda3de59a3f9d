// A router's scores, s = sigmoid(x W^T + b) per token, in fp32 from x in its own dtype, and the
// backward: dl = ds s (1 - s), dx = dl W, dW = dl^T x, db = sum dl. The reference (ops.cpp)
// upcasts x to fp32 and runs ATen's linear: an fp32 copy of the [tokens, hidden] input, then
// SIMT sgemms that read it, for a handful of outputs. Here each pass reads x once as stored;
// W (a few KB) sits in shared memory.

#include "router.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <sstream>

namespace attnsweep {
namespace {

constexpr int THREADS = 256, WARPS = THREADS / 32;
constexpr int MAX_HEADS = 16;

// W in shared memory as [heads][V][d / V]: element k of 16-byte chunk c of row h at
// (h V + k) (d / V) + c. A warp's lanes read consecutive chunks, so each of their reads of one
// (h, k) hits 32 consecutive words, one bank each (row-major, they would be V words apart:
// a V-way conflict, which made a first version 4-6x slower than this).
// A thread's loads all go out before its stores: load-store in turn, each load's round trip
// is paid one after the other, a fixed cost of every block.
template <int V>
__device__ __forceinline__ void load_weight(const float* w, int heads, int d, float* sw) {
    constexpr int BATCH = 16;  // 8 heads of 512 in one batch
    const int chunks = d / V, n = heads * d;
    for (int i0 = threadIdx.x; i0 < n; i0 += THREADS * BATCH) {
        float v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) v[u] = i0 + u * THREADS < n ? w[i0 + u * THREADS] : 0.f;
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int i = i0 + u * THREADS, h = i / d, col = i % d;
            if (i < n) sw[(h * V + col % V) * chunks + col / V] = v[u];
        }
    }
    __syncthreads();
}

// A warp takes TOKENS tokens at once, each lane 16-byte chunks of their x: every read of W
// from shared memory then serves the TOKENS tokens (one token at a time, those reads bounded
// the kernel at a third of the memory's rate).
constexpr int TOKENS = 4;

// N elements from src in one Vec-sized move where ok, else zeros (past the tokens' end).
template <typename Vec, int N, typename T>
__device__ __forceinline__ void load_or_zero(T (&dst)[N], const T* src, bool ok) {
    static_assert(sizeof(Vec) == N * sizeof(T), "one move");
    if (ok)
        *reinterpret_cast<Vec*>(dst) = *reinterpret_cast<const Vec*>(src);
    else
#pragma unroll
        for (int k = 0; k < N; ++k) dst[k] = T{};
}

// Each lane keeps a partial dot of the tokens with every head's row of W; the warp sums them.
template <typename T>
__global__ void __launch_bounds__(THREADS)
    router_forward(const T* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b, int64_t n,
                   int d, int heads, float* __restrict__ s) {
    extern __shared__ float sw[];
    constexpr int V = 16 / sizeof(T);
    load_weight<V>(w, heads, d, sw);
    const int lane = threadIdx.x % 32, chunks = d / V;
    for (int64_t t0 = ((int64_t)blockIdx.x * WARPS + threadIdx.x / 32) * TOKENS; t0 < n;
         t0 += (int64_t)gridDim.x * WARPS * TOKENS) {
        float acc[TOKENS][MAX_HEADS] = {};
        for (int c = lane * V; c < d; c += 32 * V) {
            alignas(16) T xv[TOKENS][V];
#pragma unroll
            for (int u = 0; u < TOKENS; ++u) load_or_zero<uint4>(xv[u], x + (t0 + u) * d + c, t0 + u < n);
#pragma unroll
            for (int h = 0; h < MAX_HEADS; ++h) {
                if (h >= heads) break;
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    const float wk = sw[(h * V + k) * chunks + c / V];
#pragma unroll
                    for (int u = 0; u < TOKENS; ++u) acc[u][h] = fmaf(to_float(xv[u][k]), wk, acc[u][h]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < TOKENS; ++u) {
            float mine = 0.f;
#pragma unroll
            for (int h = 0; h < MAX_HEADS; ++h) {
                if (h >= heads) break;
                for (int o = 16; o; o >>= 1) acc[u][h] += __shfl_xor_sync(0xffffffffu, acc[u][h], o);
                if (lane == h) mine = acc[u][h] + (b ? b[h] : 0.f);
            }
            if (lane < heads && t0 + u < n) s[(t0 + u) * heads + lane] = 1.f / (1.f + expf(-mine));
        }
    }
}

// dl = ds s (1 - s) of each token (written for the weight's kernel) and dx = dl W, TOKENS
// tokens a warp as in the forward.
template <typename T>
__global__ void __launch_bounds__(THREADS)
    router_dx(const float* __restrict__ ds, const float* __restrict__ s, const float* __restrict__ w, int64_t n, int d,
              int heads, float* __restrict__ dl, T* __restrict__ dx) {
    extern __shared__ float sw[];
    constexpr int V = 16 / sizeof(T);
    load_weight<V>(w, heads, d, sw);
    const int lane = threadIdx.x % 32, chunks = d / V;
    for (int64_t t0 = ((int64_t)blockIdx.x * WARPS + threadIdx.x / 32) * TOKENS; t0 < n;
         t0 += (int64_t)gridDim.x * WARPS * TOKENS) {
        float gh[TOKENS][MAX_HEADS];
#pragma unroll
        for (int u = 0; u < TOKENS; ++u) {
            const int64_t t = t0 + u;
            float g = 0.f;
            if (lane < heads && t < n) {
                const float sv = s[t * heads + lane];
                g = ds[t * heads + lane] * sv * (1.f - sv);
                dl[t * heads + lane] = g;
            }
#pragma unroll
            for (int h = 0; h < MAX_HEADS; ++h) gh[u][h] = __shfl_sync(0xffffffffu, g, h);
        }
        for (int c = lane * V; c < d; c += 32 * V) {
            float o[TOKENS][V] = {};
#pragma unroll
            for (int h = 0; h < MAX_HEADS; ++h) {
                if (h >= heads) break;
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    const float wk = sw[(h * V + k) * chunks + c / V];
#pragma unroll
                    for (int u = 0; u < TOKENS; ++u) o[u][k] = fmaf(gh[u][h], wk, o[u][k]);
                }
            }
#pragma unroll
            for (int u = 0; u < TOKENS; ++u) {
                if (t0 + u >= n) break;
                alignas(16) T r[V];
#pragma unroll
                for (int k = 0; k < V; ++k) r[k] = static_cast<T>(o[u][k]);
                *reinterpret_cast<uint4*>(dx + (t0 + u) * d + c) = *reinterpret_cast<const uint4*>(r);
            }
        }
    }
}

// Per block, the weight's and the bias's gradient over one fixed range of tokens: a thread per
// COLS consecutive columns of x (one 8-byte load of bf16, 16 bytes of fp32), eight tokens' loads
// in flight, the block's dl staged in shared memory a chunk of tokens at a time. The caller sums
// the blocks' partials (fixed ranges and order: the result does not depend on scheduling).
constexpr int CHUNK = 64, COLS = 4, IN_FLIGHT = 8;  // CHUNK a multiple of IN_FLIGHT
template <typename T>
__global__ void __launch_bounds__(THREADS)
    router_dw(const float* __restrict__ dl, const T* __restrict__ x, int64_t n, int d, int heads, int64_t per_block,
              float* __restrict__ dw, float* __restrict__ db) {
    using Cols = typename std::conditional<sizeof(T) == 2, uint2, uint4>::type;  // COLS elements
    __shared__ float sdl[CHUNK * MAX_HEADS];
    const int64_t t0 = blockIdx.x * per_block, t1 = t0 + per_block < n ? t0 + per_block : n;
    for (int c0 = 0; c0 < d; c0 += blockDim.x * COLS) {
        const int col = c0 + threadIdx.x * COLS;
        float acc[COLS][MAX_HEADS] = {}, bias = 0.f;
        for (int64_t t = t0; t < t1; t += CHUNK) {
            const int m = t1 - t < CHUNK ? (int)(t1 - t) : CHUNK;
            __syncthreads();
            // Zeros past the range's end, which the last group of IN_FLIGHT reads.
            for (int i = threadIdx.x; i < CHUNK * heads; i += blockDim.x)
                sdl[i] = i < m * heads ? dl[t * heads + i] : 0.f;
            __syncthreads();
            if (c0 == 0 && threadIdx.x < heads)
                for (int j = 0; j < m; ++j) bias += sdl[j * heads + threadIdx.x];
            if (col < d)
                for (int j = 0; j < m; j += IN_FLIGHT) {
                    alignas(16) T xv[IN_FLIGHT][COLS];
#pragma unroll
                    for (int u = 0; u < IN_FLIGHT; ++u) load_or_zero<Cols>(xv[u], x + (t + j + u) * d + col, j + u < m);
#pragma unroll
                    for (int u = 0; u < IN_FLIGHT; ++u)
#pragma unroll
                        for (int h = 0; h < MAX_HEADS; ++h) {
                            if (h >= heads) break;
                            const float g = sdl[(j + u) * heads + h];
#pragma unroll
                            for (int k = 0; k < COLS; ++k) acc[k][h] = fmaf(g, to_float(xv[u][k]), acc[k][h]);
                        }
                }
        }
        if (col < d)
#pragma unroll
            for (int h = 0; h < MAX_HEADS; ++h) {
                if (h >= heads) break;
#pragma unroll
                for (int k = 0; k < COLS; ++k) dw[((int64_t)blockIdx.x * heads + h) * d + col + k] = acc[k][h];
            }
        if (c0 == 0 && threadIdx.x < heads) db[blockIdx.x * heads + threadIdx.x] = bias;
    }
}

// The device's SMs times k: enough blocks to fill it.
int64_t filling(int k) { return (int64_t)at::cuda::getCurrentDeviceProperties()->multiProcessorCount * k; }

// Blocks for n tokens, TOKENS a warp: as many as the GPU holds at once, no more, each warp
// looping over tokens. Every block first stages W (a 16 KB read for 8 heads of 512), which
// cost more than its tokens when each warp had but one group of them.
template <typename K>
int64_t token_blocks(K kernel, int64_t n, size_t smem) {
    int resident = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, THREADS, smem));
    return std::max<int64_t>(1, std::min<int64_t>((n + WARPS * TOKENS - 1) / (WARPS * TOKENS), filling(resident)));
}

template <typename K>
void set_smem(K kernel, size_t bytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

}  // namespace

std::string cuda_router_misfit(const at::Tensor& x, const at::Tensor& w) {
    const int64_t d = x.size(-1), heads = w.size(0);
    const int64_t v = x.scalar_type() == at::kBFloat16 ? 8 : 4;
    // W in shared memory: at most what one block may opt in to (227 KiB on an H100).
    const int64_t smem = (int64_t)at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
    std::ostringstream why;
    if (heads < 1 || heads > MAX_HEADS)
        why << "the router kernel takes 1 to " << MAX_HEADS << " heads, not " << heads;
    else if (heads * d * 4 > smem)
        why << "the router kernel keeps its weight in shared memory: " << heads << " heads x " << d
            << " inputs need " << heads * d * 4 / 1024 << " KiB, the GPU gives a block " << smem / 1024 << " KiB";
    else if (d % v != 0)
        why << "the router kernel reads 16-byte chunks: its input width " << d << " must be a multiple of " << v;
    else if (!x.is_contiguous() || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0)
        why << "the router kernel reads its input in 16-byte chunks, and this one is not contiguous and aligned";
    return why.str();
}

void cuda_router_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor* b, at::Tensor& s) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n = s.numel() / w.size(0);
    if (n == 0) return;
    const int d = (int)x.size(-1), heads = (int)w.size(0);
    const size_t smem = (size_t)heads * d * 4;
    dispatch_float(x, [&](auto t) {
        using T = decltype(t);
        set_smem(router_forward<T>, smem);
        router_forward<T><<<token_blocks(router_forward<T>, n, smem), THREADS, smem, at::cuda::getCurrentCUDAStream()>>>(
            static_cast<const T*>(x.data_ptr()), w.data_ptr<float>(), b ? b->data_ptr<float>() : nullptr, n, d, heads,
            s.data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cuda_router_backward(const at::Tensor& ds, const at::Tensor& s, const at::Tensor& x, const at::Tensor& w,
                          at::Tensor& dx, at::Tensor& dw, at::Tensor& db) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n = s.numel() / w.size(0);
    const int d = (int)x.size(-1), heads = (int)w.size(0);
    if (n == 0) {
        dw.zero_(), db.zero_();
        return;
    }
    auto dl = at::empty_like(s);
    const size_t smem = (size_t)heads * d * 4;
    // Token ranges of the weight's partial sums: enough blocks to fill the GPU, a few thousand
    // floats of partials each.
    const int64_t blocks = std::min<int64_t>(n, filling(4)), per_block = (n + blocks - 1) / blocks;
    const int64_t used = (n + per_block - 1) / per_block;
    auto pw = at::empty({used, heads, d}, s.options()), pb = at::empty({used, heads}, s.options());
    auto stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(x, [&](auto t) {
        using T = decltype(t);
        set_smem(router_dx<T>, smem);
        router_dx<T><<<token_blocks(router_dx<T>, n, smem), THREADS, smem, stream>>>(ds.data_ptr<float>(), s.data_ptr<float>(),
                                                                 w.data_ptr<float>(), n, d, heads, dl.data_ptr<float>(),
                                                                 static_cast<T*>(dx.data_ptr()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        // A row of x (d / COLS threads) a block, up to THREADS.
        const int threads = std::min<int>(THREADS, (d / COLS + 31) / 32 * 32);
        router_dw<T><<<used, threads, 0, stream>>>(dl.data_ptr<float>(), static_cast<const T*>(x.data_ptr()), n, d,
                                                   heads, per_block, pw.data_ptr<float>(), pb.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    at::sum_out(dw, pw, {0});
    at::sum_out(db, pb, {0});
}

}  // namespace attnsweep
