// The optimizer step over every parameter in two launches: the global gradient norm, then
// clipping and AdamW together. Written out per tensor, the same step is about fifteen small
// element-wise launches per parameter, and for a model of ~100 tensors their launch cost,
// not their memory traffic, sets the step time.
//
// Both kernels walk a chunk table (multi-tensor apply): each block takes one chunk of up to
// CHUNK elements of one tensor, so one launch covers tensors of any sizes. The maths is the
// reference's in ops.cpp (and train.rs), element by element:
//   g <- g * clip;  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   p <- p (1 - lr wd)   (matrices only);   p <- p - lr / bc1 * m / (sqrt(v / bc2) + eps)

#include "optim.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <vector>

namespace attnsweep {
namespace {

constexpr int64_t CHUNK = 1 << 16;
constexpr int THREADS = 512;

struct Slot {
    float *p, *g, *m, *v;
    int64_t n;
    float decay;  // 1 - lr wd for matrices, 1 otherwise
};

struct Chunk {
    int slot;
    int64_t start;
};

// Sum of squares of each chunk's gradient, into partial[chunk].
__global__ void sumsq_kernel(const Slot* slots, const Chunk* chunks, float* partial) {
    const Chunk c = chunks[blockIdx.x];
    const Slot s = slots[c.slot];
    const int64_t end = min(c.start + CHUNK, s.n);
    float acc = 0.f;
    for (int64_t i = c.start + threadIdx.x; i < end; i += THREADS) acc += s.g[i] * s.g[i];
    __shared__ float warp_sums[THREADS / 32];
    for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < THREADS / 32 ? warp_sums[threadIdx.x] : 0.f;
        for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (threadIdx.x == 0) partial[blockIdx.x] = acc;
    }
}

__global__ void adamw_kernel(const Slot* slots, const Chunk* chunks, AdamWStep h) {
    const Chunk c = chunks[blockIdx.x];
    const Slot s = slots[c.slot];
    const int64_t end = min(c.start + CHUNK, s.n);
    const float step = h.lr / h.bc1;
    for (int64_t i = c.start + threadIdx.x; i < end; i += THREADS) {
        const float g = s.g[i] * h.clip;
        const float m = h.beta1 * s.m[i] + (1.f - h.beta1) * g;
        const float v = h.beta2 * s.v[i] + (1.f - h.beta2) * g * g;
        s.m[i] = m;
        s.v[i] = v;
        if (h.clip != 1.f) s.g[i] = g;
        s.p[i] = s.p[i] * s.decay - step * m / (sqrtf(v / h.bc2) + h.eps);
    }
}

// The chunk table of `slots` on the device, as one int64 tensor holding Slot and Chunk arrays.
struct Table {
    at::Tensor buf;
    const Slot* slots;
    const Chunk* chunks;
    int n_chunks;
};

Table upload(const std::vector<Slot>& slots, const at::Tensor& like) {
    std::vector<Chunk> chunks;
    for (int i = 0; i < (int)slots.size(); ++i)
        for (int64_t s = 0; s < slots[i].n; s += CHUNK) chunks.push_back({i, s});
    const size_t a = slots.size() * sizeof(Slot), b = chunks.size() * sizeof(Chunk);
    auto host = at::empty({(int64_t)((a + b + 7) / 8)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), slots.data(), a);
    std::memcpy(static_cast<char*>(host.data_ptr()) + a, chunks.data(), b);
    auto dev = host.to(like.device(), /*non_blocking=*/true);
    auto base = static_cast<const char*>(dev.data_ptr());
    return {dev, reinterpret_cast<const Slot*>(base), reinterpret_cast<const Chunk*>(base + a), (int)chunks.size()};
}

std::vector<Slot> slots_of(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
                           const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v, const AdamWStep* h) {
    std::vector<Slot> slots;
    for (size_t i = 0; i < p.size(); ++i) {
        const float decay = h && p[i].dim() >= 2 && h->weight_decay > 0 ? 1.f - h->lr * h->weight_decay : 1.f;
        slots.push_back({p[i].data_ptr<float>(), g[i].data_ptr<float>(), m.empty() ? nullptr : m[i].data_ptr<float>(),
                         v.empty() ? nullptr : v[i].data_ptr<float>(), p[i].numel(), decay});
    }
    return slots;
}

}  // namespace

at::Tensor cuda_grad_norm(const std::vector<at::Tensor>& grads) {
    const c10::cuda::CUDAGuard guard(grads[0].device());
    auto t = upload(slots_of(grads, grads, {}, {}, nullptr), grads[0]);
    auto partial = at::zeros({t.n_chunks}, grads[0].options());
    if (t.n_chunks == 0) return partial.sum();  // every gradient empty: no launch of zero blocks
    auto stream = at::cuda::getCurrentCUDAStream();
    sumsq_kernel<<<t.n_chunks, THREADS, 0, stream>>>(t.slots, t.chunks, partial.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return partial.sum().sqrt();
}

void cuda_adamw(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& m,
                const std::vector<at::Tensor>& v, const AdamWStep& h) {
    const c10::cuda::CUDAGuard guard(p[0].device());
    auto t = upload(slots_of(p, g, m, v, &h), p[0]);
    if (t.n_chunks == 0) return;
    adamw_kernel<<<t.n_chunks, THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(t.slots, t.chunks, h);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attnsweep
