// The list attention (attention.cu states what it computes) on Hopper's warpgroup matrix
// instructions and its tensor copy engine: the forward and the backward. The
// mma.sync forward stays latency-bound near 180 TFLOP/s on an H100 (PERFORMANCE.md, v3):
// operands pass through registers and too few warps fit to hide the softmax. Here wgmma reads
// the operands of Q K^T and the V operand of P V straight from shared memory, asynchronously.
// These kernels run on compute capability 9.0; the mma.sync kernels run on every other GPU.
//
// A block owns 128 queries and has three roles: two consumer warpgroups of 64 query rows and
// one producer warp. The producer streams key/value tiles with the tensor copy engine (TMA)
// into a ring of stages, each with a "full" and an "empty" mbarrier, so the consumers never
// wait on each other: while one warpgroup runs its softmax, the other's matrix products keep
// the tensor cores busy. S = Q K^T takes Q and K from shared memory; P V takes P from
// registers (the accumulator layout of S is the A-register layout, as with mma.sync) and reads
// V "MN-major", as stored, with no transposed copy. A warpgroup skips the tiles none of its
// rows can see.

#include "attention.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace attnsweep {
namespace {

// wgmma exists only when compiling for sm_90a; elsewhere the kernel body is empty and the
// launcher is never reached (cuda_forward dispatches on the device).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNSWEEP_HAS_WGMMA 1
#endif

constexpr int BQ = 128;        // queries per block
constexpr int CONSUMERS = BQ / 64 * 128;  // a warpgroup per 64 query rows
constexpr int THREADS = CONSUMERS + 32;

struct Params : ListShape {
    const __nv_bfloat16 *q, *dout;  // read at the rows' positions where the list works at positions
    __nv_bfloat16* out;  // the output (forward), dQ, or dK (kv_kernel)
    __nv_bfloat16* dv;   // kv_kernel's dV
    float* lse;          // written by the forward
    const float *lse_in, *delta;  // read by the backward
};

// Tiles in shared memory use the canonical 128-byte-swizzle layout, which TMA writes and wgmma
// reads: a [rows x D] bf16 tile is D / 64 column blocks of [rows x 64], rows of 128 bytes, and
// 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row (so the eight rows a tensor
// core reads at once hit distinct banks). Column blocks start on 1024-byte boundaries.

// Shared-memory matrix descriptor (PTX ISA, "matrix descriptor"): start address, leading and
// stride byte offsets (16-byte units), 128-byte swizzle. K-major operands (Q, K) use only the
// stride offset, the distance between 8-row groups; MN-major V also uses the leading offset,
// the distance between its 64-column blocks.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// Pins accumulator registers at this point of the program: reads after a wait and writes
// before an issue must not be moved across the asynchronous instructions.
template <int N>
__device__ __forceinline__ void fence_registers(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and announces the bytes the copy engine will deliver to complete this phase.
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}

// Starts a 4-byte copy from global to shared memory (completion tracked per thread).
__device__ __forceinline__ void copy4(uint32_t dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// The same, 16 bytes.
__device__ __forceinline__ void copy16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// Copies a [rows x 64] box at (column c, row r) of a 2-D tensor map into shared memory,
// completing on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c, int r, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c), "r"(r), "r"(bar)
        : "memory");
}

// d (64 x 64, fp32) = A (64 x 16, smem) * B (64 x 16, smem, K-major) (+ d if accumulate).
__device__ __forceinline__ void wgmma_ss_n64(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 128, fp32) = A (64 x 16, smem) * B (128 x 16, smem, K-major) (+ d if accumulate).
__device__ __forceinline__ void wgmma_ss_n128(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 64, fp32) += A (64 x 16, registers) * B (16 x 64, smem, MN-major).
__device__ __forceinline__ void wgmma_rs_n64(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// d (64 x 128, fp32) += A (64 x 16, registers) * B (16 x 128, smem, MN-major).
__device__ __forceinline__ void wgmma_rs_n128(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// d (64 x N) = A B^T summed over D: A the 64 rows at shared address a, B the N rows at b, both
// K-major in the swizzled layout, their 64-column blocks a_block and b_block bytes apart.
// Issued, not committed. k-step kk reads column block kk / 4, 32 bytes further into its 128-byte
// rows per step (the swizzle applies to the address, so the step is a plain offset).
template <int D, int N>
__device__ __forceinline__ void issue_scores(float* d, uint32_t a, uint32_t a_block, uint32_t b, uint32_t b_block) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t col = (kk % 4) * 32;
        const uint64_t da = descriptor(a + (kk / 4) * a_block + col, 16, 1024);
        const uint64_t db = descriptor(b + (kk / 4) * b_block + col, 16, 1024);
        if constexpr (N == 128) wgmma_ss_n128(d, da, db, kk > 0);
        else wgmma_ss_n64(d, da, db, kk > 0);
    }
}

// s = A B^T and, when TWO, d2 = A2 B2^T (A, A2 alike in layout, as are B, B2): both issued
// together and awaited.
template <int D, int N, bool TWO>
__device__ __forceinline__ void scores(float* s, float* d2, uint32_t a, uint32_t a2, uint32_t a_block, uint32_t b,
                                       uint32_t b2, uint32_t b_block) {
    wgmma_fence();
    issue_scores<D, N>(s, a, a_block, b, b_block);
    if constexpr (TWO) issue_scores<D, N>(d2, a2, a_block, b2, b_block);
    wgmma_commit();
    wgmma_wait();
    fence_registers<N / 2>(s);
    if constexpr (TWO) fence_registers<N / 2>(d2);
}

// acc (64 x D) += bf16(s) B: s is a [64 x KT] fp32 accumulator tile (k-step j of the product
// covers its columns [16 j, 16 j + 16), the accumulator blocks 2j and 2j+1, which is the A
// register layout), B a [KT x D] tile at shared address sb read MN-major (as stored: rows of
// D, 64-column blocks KT * 128 bytes apart). Issued and awaited.
template <int D, int KT>
__device__ __forceinline__ void accumulate(float* acc, const float* s, uint32_t sb) {
    uint32_t pa[KT / 16][4];
#pragma unroll
    for (int j = 0; j < KT / 16; ++j) {
        pa[j][0] = pack_bf16(s[8 * j + 0], s[8 * j + 1]);
        pa[j][1] = pack_bf16(s[8 * j + 2], s[8 * j + 3]);
        pa[j][2] = pack_bf16(s[8 * j + 4], s[8 * j + 5]);
        pa[j][3] = pack_bf16(s[8 * j + 6], s[8 * j + 7]);
    }
    fence_registers<D / 2>(acc);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < KT / 16; ++j) {
        const uint64_t db = descriptor(sb + j * (16 * 128), KT * 128, 1024);
        if constexpr (D == 128) wgmma_rs_n128(acc, pa[j], db);
        else wgmma_rs_n64(acc, pa[j], db);
    }
    wgmma_commit();
    wgmma_wait();
    fence_registers<D / 2>(acc);
}

// 2^x on the special-function unit, flushing denormals (what exp2f adds range handling for).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Tensor maps view q and dout as [B * H * Lq, D] and k, v as [B * Hkv * L, D]. Rows a box
// takes past a head's end belong to the next head (or are zeros past the tensor's end): such
// keys are masked and such queries' outputs are not written.
//
// One kernel for two computations over the same tiles:
// - forward (DQ = false): online softmax of S = Q K^T, O += P V; writes out and lse;
// - dQ (DQ = true): P = exp(S * scale - lse) from the forward's lse, dP = dO V^T,
//   dS = P (dP - delta), dQ += dS K; the K tile serves both products (K-major for S,
//   MN-major for dQ) as V does in the forward.
// BK keys per tile: 128 halves the per-tile overhead (waits, row reductions, rescales), 64
// wastes less on a narrow band's edge tiles (and leaves dQ's three accumulators room).
// Blocks an SM: two for the head_dim-64 forward on 64-key tiles, one for the others. Two
// blocks of nine warps fit an SM's register file only at 96 registers a thread or fewer (an
// SM sub-partition holds five of their warps): this kernel takes 100 unbounded (118 for PPA)
// and 94-96 bounded (PPA spills 8 bytes); 128-key tiles (138) and dQ (136) would spill
// hundreds of bytes, so they keep one.
template <int D, int BK, bool DQ>
constexpr int list_blocks() {
    return D == 64 && BK == 64 && !DQ ? 2 : 1;
}

template <int D, int BK, bool DQ, bool FAR>
__global__ void __launch_bounds__(THREADS, list_blocks<D, BK, DQ>())
    list_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, Params p) {
    static_assert(!DQ || BK == 64, "dQ keeps S, dP and dQ in registers: 64-key tiles only");
#ifdef ATTNSWEEP_HAS_WGMMA
    constexpr int STAGES = BK == 64 ? 3 : 2;
    extern __shared__ unsigned char smem_raw[];
    __shared__ int spos[BQ];
    __shared__ __align__(8) uint64_t bars[1 + 2 * STAGES];  // Q full, then full and empty per stage
    // Q [BQ x D] (and dO, for DQ), then STAGES x (K [BK x D], V [BK x D]), from a 1024-byte
    // boundary.
    constexpr uint32_t Q_BYTES = BQ * D * 2, T_BYTES = BK * D * 2, QS = DQ ? 2 : 1;
    const uint32_t sq = (smem_addr(smem_raw) + 1023) & ~1023u, sdo = sq + Q_BYTES;
    const uint32_t q_full = smem_addr(&bars[0]);
    auto full = [&](int s) { return smem_addr(&bars[1 + s]); };
    auto empty = [&](int s) { return smem_addr(&bars[1 + STAGES + s]); };
    auto stage_k = [&](int s) { return sq + QS * Q_BYTES + s * 2 * T_BYTES; };

    // Blocks start in the order of their linear index, heads fastest: every head's longest
    // query tiles first (tile_at).
    const auto [bh, b, h, kvh, nq, nfull, row0, qbase] = query_tile(p, blockIdx.x, blockIdx.y, gridDim.y, BQ);
    if (row0 >= nq) {
        zero_rows<D>(p, p.out, DQ ? nullptr : p.lse, qbase, row0, BQ);
        return;
    }
    load_positions<BQ>(spos, p.qpos, qbase, row0, 0, nq);
    if (threadIdx.x == 0) {
        // Q arrives by one tensor copy, or by the producer warp's lanes 1-31 (at positions).
        bar_init(q_full, p.at_positions ? 31 : 1);
        for (int s = 0; s < STAGES; ++s) {
            bar_init(full(s), 1);
            bar_init(empty(s), CONSUMERS / 32);  // every consumer warp releases a stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int last = min(row0 + BQ, nq) - 1 - row0;
    const RowSpan span = row_span(spos, 0, last, nfull - row0, p.window, p.len);
    const FarView<FAR> fv(p);
    const int t_first = first_tile(fv, span, BK), t_last = span.key_hi / BK;

    if (threadIdx.x >= CONSUMERS) {
        // Producer: lane 0 issues every tensor copy; a stage is refilled once both
        // warpgroups have released it.
        const int lane = threadIdx.x % 32;
        const int kv_row0 = (b * p.kv_heads + kvh) * p.len;
        // The i-th tile the block sees, t.
        auto load_kv = [&](int i, int t) {
            const int s = i % STAGES;
            if (i >= STAGES) bar_wait(empty(s), (i / STAGES - 1) & 1);
            bar_expect(full(s), 2 * T_BYTES);
            for (int c = 0; c < D / 64; ++c) {
                tma_load(stage_k(s) + c * (BK * 128), &tk, c * 64, kv_row0 + t * BK, full(s));
                tma_load(stage_k(s) + T_BYTES + c * (BK * 128), &tv, c * 64, kv_row0 + t * BK, full(s));
            }
        };
        // Q (and dO) rows at the rows' positions, which no tensor copy can gather: lanes 1-31
        // start 16-byte copies into the swizzled layout (chunk c of row r at c ^ (r % 8)),
        // lane 0 fills the first stages meanwhile (they need no release), and the copies are
        // then ordered before the tensor cores' reads.
        const bool gather_q = p.at_positions && lane > 0;
        if (gather_q) {
            for (int i = lane - 1; i < BQ * (D / 8); i += 31) {
                const int r = i / (D / 8), c = i % (D / 8);
                const int64_t src = (qbase + p.qpos[qbase + min(row0 + r, p.lq - 1)]) * D + c * 8;
                const uint32_t at = (c / 8) * (BQ * 128) + r * 128 + ((c % 8) ^ (r % 8)) * 16;
                copy16(sq + at, p.q + src);
                if (DQ) copy16(sdo + at, p.dout + src);
            }
        }
        int t = t_first, i = 0;
        if (lane == 0) {
            if (!p.at_positions) {
                bar_expect(q_full, QS * Q_BYTES);
                for (int c = 0; c < D / 64; ++c) {
                    tma_load(sq + c * (BQ * 128), &tq, c * 64, (int)(qbase + row0), q_full);
                    if (DQ) tma_load(sdo + c * (BQ * 128), &tdo, c * 64, (int)(qbase + row0), q_full);
                }
            }
            for (; t <= t_last && i < STAGES; t = next_tile(fv, t, span, BK), ++i) load_kv(i, t);
        }
        if (gather_q) {
            asm volatile("cp.async.wait_all;\nfence.proxy.async.shared::cta;\n" ::: "memory");
            bar_arrive(q_full);
        }
        if (lane == 0)
            for (; t <= t_last; t = next_tile(fv, t, span, BK), ++i) load_kv(i, t);
        return;
    }

    const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    // This warpgroup's rows and the keys they can see (none when it has no rows).
    const int w_first = wg * 64, w_last = min(wg * 64 + 63, last);
    const RowSpan ws = w_first <= last ? row_span(spos, w_first, w_last, nfull - row0, p.window, p.len)
                                       : RowSpan{INT32_MAX, -1, 0, -1};
    const int r_lo = wg * 64 + warp * 16 + lane / 4;
    const int pos_row[2] = {spos[r_lo], spos[r_lo + 8]};
    // The window of this thread's row hr (r_lo + 8 hr), from one register.
    const int nfull_here = nfull - row0 - r_lo;
    auto win_row = [&](int hr) { return row_window(8 * hr, nfull_here, p.window); };
    // Scores in log2 units, so exp2 replaces exp.
    const float scale2 = p.scale * 1.4426950408889634f;

    // acc: O (forward) or dQ. Forward: running max m and sum l per row. dQ: the row's lse in
    // log2 units (+inf for rows without a query, so their P is 0) and delta.
    float acc[D / 2] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    if constexpr (DQ) {
        for (int hr = 0; hr < 2; ++hr) {
            const bool ok = pos_row[hr] >= 0;
            const int64_t r = qbase + row0 + r_lo + hr * 8;
            m[hr] = ok ? p.lse_in[r] * 1.4426950408889634f : INFINITY;
            l[hr] = ok ? p.delta[r] : 0.f;
        }
    }
    bar_wait(q_full, 0);
    for (int t = t_first, i = 0; t <= t_last; t = next_tile(fv, t, span, BK), ++i) {
        const int st = i % STAGES;
        const int k0 = t * BK;
        // Every warp waits for the tile, even one that skips it: a warp that released stages
        // unread could otherwise run a whole ring ahead and release a later phase early.
        bar_wait(full(st), (i / STAGES) & 1);
        const bool seen = FAR ? sees_any(fv, ws.pmin - (k0 + BK - 1), ws.key_hi - k0, p.window)
                                : k0 <= ws.key_hi && k0 + BK - 1 >= ws.key_lo;
        if (seen) {
            const uint32_t sk = stage_k(st), sv = sk + T_BYTES;
            float s[BK / 2], dp[DQ ? BK / 2 : 1];
            // This warpgroup's 64 rows of Q (and dO) against the tile's keys (and values).
            scores<D, BK, DQ>(s, dp, sq + wg * (64 * 128), sdo + wg * (64 * 128), BQ * 128, sk, sv, BK * 128);

            // The mask only on tiles not wholly inside every row's window: a branch taken by the
            // whole warpgroup, so interior tiles pay nothing for it.
            if (!inside(ws, k0, BK, p.window, p.len)) {
                // PPA's bits of this thread's rows: bit i of far[hr][h] is distance dlow + 64 h +
                // i, dlow the row's distance to its last column less BK - 1. They hold the window
                // and are zero below distance 0, so with them one bit test is the whole mask.
                uint64_t far[2][BK / 64];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                    for (int h = 0; h < BK / 64; ++h)
                        far[hr][h] = far_bits64(fv, pos_row[hr] - k0 - (lane % 4) * 2 - (BK - 1) + 64 * h);
#pragma unroll
                for (int e = 0; e < BK / 2; ++e) {
                    const int key = k0 + (e / 4) * 8 + (lane % 4) * 2 + (e & 1), hr = (e >> 1) & 1;
                    const int idx = BK - 1 - (e / 4) * 8 - (e & 1);  // pos - key - dlow
                    // dQ keeps the window's comparisons before the bit: at D = 128 the bit
                    // test alone makes ptxas spill 76 bytes there, the forward none.
                    const bool bit = (far[hr][idx / 64] >> (idx % 64)) & 1;
                    const bool ok = FAR && !DQ ? bit : visible(key, pos_row[hr], win_row(hr), p.len) || bit;
                    if (!ok) s[e] = -INFINITY;
                }
            }
            if constexpr (DQ) {
#pragma unroll
                for (int e = 0; e < BK / 2; ++e) {
                    const int hr = (e >> 1) & 1;
                    s[e] = ex2(fmaf(s[e], scale2, -m[hr])) * (dp[e] - l[hr]);  // dS
                }
            } else {
                // Online softmax on raw scores; the scale (in log2 units) is folded into one FMA
                // per score before ex2.
                float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int e = 0; e < BK / 2; ++e) mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[e]);
                float corr[2];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffff, mx[hr], 1));
                    mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffff, mx[hr], 2));
                    const float m_new = fmaxf(m[hr], mx[hr] * scale2);
                    // A row that has seen no key yet keeps m = -inf; subtracting 0 keeps exp finite.
                    const float base = m_new == -INFINITY ? 0.f : m_new;
                    corr[hr] = ex2(m[hr] - base);
                    m[hr] = m_new;
                    float sum = 0.f;
#pragma unroll
                    for (int e = 0; e < BK / 2; ++e)
                        if (((e >> 1) & 1) == hr) {
                            s[e] = ex2(fmaf(s[e], scale2, -base));
                            sum += s[e];
                        }
                    sum += __shfl_xor_sync(0xffffffff, sum, 1);
                    sum += __shfl_xor_sync(0xffffffff, sum, 2);
                    l[hr] = l[hr] * corr[hr] + sum;
                }
                // Once the row maxima settle, most tiles leave them unchanged: skip the rescale then.
                if (__any_sync(0xffffffff, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
                    for (int e = 0; e < D / 2; ++e) acc[e] *= corr[(e >> 1) & 1];
                }
            }

            // P V (forward) or dS K (dQ).
            accumulate<D, BK>(acc, s, DQ ? sk : sv);
        }
        // This warp is done with the stage (a warpgroup that skips the tile releases it unread).
        if (lane == 0) bar_arrive(empty(st));
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = row0 + r_lo + hr * 8;
        if (r >= p.lq) continue;
        const bool ok = pos_row[hr] >= 0;
        const float f = !ok ? 0.f : DQ ? p.scale : 1.f / l[hr];
        __nv_bfloat16* orow = p.out + out_row(p, qbase, r) * D;
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb) {
            const int c = nb * 8 + (lane % 4) * 2;
            *reinterpret_cast<__nv_bfloat162*>(orow + c) =
                __floats2bfloat162_rn(acc[4 * nb + 2 * hr] * f, acc[4 * nb + 2 * hr + 1] * f);
        }
        // Natural-log log-sum-exp of the scaled scores, which backward recomputes P from.
        if (!DQ && lane % 4 == 0)
            p.lse[qbase + r] = ok ? (m[hr] + __log2f(l[hr])) * 0.6931471805599453f : -INFINITY;
    }
#endif
}

// A warpgroup's [64 x D] accumulator times f, as bf16 rows rows[0] and rows[1] of out (those
// below len).
template <int D>
__device__ __forceinline__ void store_rows(const float* acc, __nv_bfloat16* out, const int* rows, int len, float f) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        if (rows[hr] >= len) continue;
        __nv_bfloat16* row = out + (int64_t)rows[hr] * D;
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb)
            *reinterpret_cast<__nv_bfloat162*>(row + nb * 8 + lane % 4 * 2) =
                __floats2bfloat162_rn(acc[4 * nb + 2 * hr] * f, acc[4 * nb + 2 * hr + 1] * f);
    }
}

// dK and dV: key tiles outer. A block owns 128 keys (a warpgroup per 64) and streams 64-query
// tiles of Q and dO, with their positions, lse and delta, over every query head of its KV
// head's group and, in each of its list's two groups (a routed list's full-prefix rows, then
// the window rows), only the queries that can see its keys (found by searching the list).
// Per tile: S^T = K Q^T and dP^T = V dO^T, P^T = exp(S^T scale - lse), dV += P^T dO,
// dS^T = P^T (dP^T - delta), dK += dS^T Q: both outputs in one pass, S and P computed once.
// At D = 128 a consumer thread holds both [64 x D] accumulators, S and dP (~220 registers),
// more than an even share of the register file gives three warpgroups (168), so the producer
// is a whole warpgroup that hands its registers to the consumers (setmaxnreg: 40 + 2 x 232 =
// 3 x 168, the count each thread starts with); only its first warp works. Before, each output
// took a launch at D = 128, computing S and P twice (PERFORMANCE.md, the fused dK/dV entry).
constexpr int BKEYS = 128;  // keys per block
constexpr int BQT = 64;     // queries per tile
constexpr int KV_THREADS = CONSUMERS + 128;
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * CONSUMERS == 65536 / KV_THREADS / 8 * 8 * KV_THREADS,
              "setmaxnreg must redistribute exactly the registers the block starts with");

template <int D, bool FAR>
__global__ void __launch_bounds__(KV_THREADS, 1)
    kv_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
              const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, Params p) {
#ifdef ATTNSWEEP_HAS_WGMMA
    constexpr int STAGES = 3;
    extern __shared__ unsigned char smem_raw[];
    __shared__ int tpos[STAGES][BQT];
    __shared__ __align__(8) float tlse[STAGES][BQT], tdl[STAGES][BQT];
    __shared__ __align__(8) uint64_t bars[1 + 2 * STAGES];  // K/V full, then full and empty per stage
    // K, V [BKEYS x D], then STAGES x (Q [BQT x D], dO [BQT x D]), from a 1024-byte boundary.
    constexpr uint32_t KV_BYTES = BKEYS * D * 2, T_BYTES = BQT * D * 2;
    const uint32_t sk = (smem_addr(smem_raw) + 1023) & ~1023u, sv = sk + KV_BYTES;
    const uint32_t kv_full = smem_addr(&bars[0]);
    auto full = [&](int s) { return smem_addr(&bars[1 + s]); };
    auto empty = [&](int s) { return smem_addr(&bars[1 + STAGES + s]); };
    auto stage_q = [&](int s) { return sk + 2 * KV_BYTES + s * 2 * T_BYTES; };

    const int bkv = blockIdx.x, b = bkv / p.kv_heads, kvh = bkv % p.kv_heads;
    const int group = p.heads / p.kv_heads;
    const FarView<FAR> fv(p);
    // Key tile 0 first: low keys are seen by the most queries.
    const int kb0 = blockIdx.y * BKEYS;
    const int64_t kvbase = (int64_t)bkv * p.len;
    if (threadIdx.x == 0) {
        bar_init(kv_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            // The producer's arrive with the copy bytes, and one per lane when its cp.async
            // copies of the tile's positions, lse and delta land.
            bar_init(full(s), 33);
            bar_init(empty(s), CONSUMERS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // Query head g of the group: where its list starts, how many rows are active, how many of
    // them see their whole prefix.
    auto tile_rows = [&](int g, int64_t& base, int& nq, int& nfull) {
        const int bh = b * p.heads + kvh * group + g;
        base = (int64_t)bh * p.lq;
        nq = p.nq ? p.nq[bh] : p.lq;
        nfull = p.nfull ? p.nfull[bh] : 0;
    };
    // The list rows of each (query head g, group) that can see a key of this block: in the
    // group's rows, positions in [kb0, kb0 + BKEYS - 1 + window - 1], found by the whole block
    // together (a binary search by one thread would be a chain of dependent loads per block).
    int* ranges = reinterpret_cast<int*>(smem_raw + (sk - smem_addr(smem_raw)) + 2 * KV_BYTES + STAGES * 2 * T_BYTES);
    for (int gs = 0; gs < 2 * group; ++gs) {
        int64_t base;
        int n, nfull;
        tile_rows(gs / 2, base, n, nfull);
        const RowGroup rg = row_group(gs % 2, n, nfull, p.window);
        // PPA's far distances reach every later query.
        const int64_t hi_pos = FAR ? INT32_MAX : min((int64_t)kb0 + BKEYS - 1 + rg.window, (int64_t)INT32_MAX);
        for (int side = 0; side < 2; ++side) {
            const int key = side == 0 ? kb0 : (int)hi_pos;
            if (!p.qpos) {
                if (threadIdx.x == 0) ranges[2 * gs + side] = first_at_or_after(nullptr, base, rg.hi, key);
                continue;
            }
            // First index in [lo, hi) whose position is >= key (hi if none): each round samples
            // KV_THREADS evenly spaced entries and keeps the gap where the positions cross key.
            int lo = rg.lo, hi = rg.hi;
            while (lo < hi) {
                const int stride = (hi - lo + KV_THREADS - 1) / KV_THREADS;
                const int idx = lo + threadIdx.x * stride;
                const int below = __syncthreads_count(idx < hi && p.qpos[base + idx] < key);
                if (below == 0) break;
                const int next_hi = min(lo + below * stride, hi);
                lo = lo + (below - 1) * stride + 1;
                hi = next_hi;
            }
            if (threadIdx.x == 0) ranges[2 * gs + side] = lo;
        }
    }
    __syncthreads();
    // The block's query tiles in order, shared by the producer and the consumers: f(i, base,
    // end, r0, window) for the i-th tile, rows [r0, r0 + BQT) of the list at base, rows from
    // `end` on outside the tile's group, `window` the group's.
    auto walk = [&](auto&& f) {
        int i = 0;
        for (int gs = 0; gs < 2 * group; ++gs) {
            int64_t base;
            int nq, nfull;
            tile_rows(gs / 2, base, nq, nfull);
            const RowGroup rg = row_group(gs % 2, nq, nfull, p.window);
            const int end = ranges[2 * gs + 1];
            for (int r0 = seen_rows_from(fv, ranges[2 * gs], end, kb0, BKEYS, BQT); r0 < end;
                 r0 = seen_rows_from(fv, r0 + BQT, end, kb0, BKEYS, BQT))
                f(i++, base, rg.hi, r0, rg.window);
        }
    };

    if (threadIdx.x >= CONSUMERS) {
        // Producer: its first warp's lanes copy each tile's positions (lists only), lse and
        // delta with cp.async; lane 0 issues the tensor copies.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        if (threadIdx.x >= CONSUMERS + 32) return;
        const int lane = threadIdx.x % 32;
        if (lane == 0) {
            bar_expect(kv_full, 2 * KV_BYTES);
            for (int c = 0; c < D / 64; ++c) {
                tma_load(sk + c * (BKEYS * 128), &tk, c * 64, (int)(kvbase + kb0), kv_full);
                tma_load(sv + c * (BKEYS * 128), &tv, c * 64, (int)(kvbase + kb0), kv_full);
            }
        }
        walk([&](int i, int64_t base, int end, int r0, int) {
            const int s = i % STAGES;
            if (i >= STAGES) bar_wait(empty(s), (i / STAGES - 1) & 1);
            for (int c = lane; c < BQT; c += 32) {
                const int r = min(r0 + c, end - 1);  // rows past the group: any valid address, unused
                copy4(smem_addr(&tlse[s][c]), p.lse_in + base + r);
                copy4(smem_addr(&tdl[s][c]), p.delta + base + r);
                if (p.qpos) copy4(smem_addr(&tpos[s][c]), p.qpos + base + r);
            }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full(s)) : "memory");
            if (lane == 0) {
                bar_expect(full(s), 2 * T_BYTES);
                for (int c = 0; c < D / 64; ++c) {
                    tma_load(stage_q(s) + c * (BQT * 128), &tq, c * 64, (int)(base + r0), full(s));
                    tma_load(stage_q(s) + T_BYTES + c * (BQT * 128), &tdo, c * 64, (int)(base + r0), full(s));
                }
            }
        });
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int kw0 = kb0 + wg * 64;  // this warpgroup's first key
    const int key_row[2] = {kw0 + warp * 16 + lane / 4, kw0 + warp * 16 + lane / 4 + 8};
    const float scale2 = p.scale * 1.4426950408889634f;
    float dv_acc[D / 2] = {}, dk_acc[D / 2] = {};
    bar_wait(kv_full, 0);
    walk([&](int i, int64_t, int end, int r0, int window) {
        const int st = i % STAGES;
        bar_wait(full(st), (i / STAGES) & 1);
        const int n = min(BQT, end - r0);  // rows of the tile's group; positions ascend over them
        auto pos = [&](int c) { return p.qpos ? tpos[st][c] : r0 + c; };
        const int pmin = pos(0), pmax = pos(n - 1);
        const bool seen = FAR ? sees_any(fv, pmin - (kw0 + 63), pmax - kw0, window)
                                : kw0 < p.len && pmax >= kw0 && pmin - (kw0 + 63) < window;
        if (seen) {
            const uint32_t sq = stage_q(st), sdo = sq + T_BYTES;
            float s[BQT / 2], dp[BQT / 2];
            // This warpgroup's 64 keys and values against the tile's queries and dO rows.
            scores<D, BQT, true>(s, dp, sk + wg * (64 * 128), sv + wg * (64 * 128), BKEYS * 128, sq, sdo, BQT * 128);
            // Every pair visible: all rows hold queries and the whole tile lies in every
            // key's window (warpgroup-uniform, so the branch costs interior tiles nothing).
            const bool interior = n == BQT && pmin >= kw0 + 63 && pmax - kw0 < window && kw0 + 63 < p.len;
            if (!interior) {
                // PPA's bits (dense lists: query c at r0 + c): bit i of far[hr] is the distance
                // from key_row[hr] to query column r0 + 2 (lane % 4) + i, window included.
                const uint64_t far[2] = {far_bits64(fv, r0 + (lane % 4) * 2 - key_row[0]),
                                         far_bits64(fv, r0 + (lane % 4) * 2 - key_row[1])};
#pragma unroll
                for (int e = 0; e < BQT / 2; ++e) {
                    const int c = (e / 4) * 8 + (lane % 4) * 2 + (e & 1), hr = (e >> 1) & 1;
                    const int key = key_row[hr], q = pos(c);
                    const bool seen = FAR ? (far[hr] >> ((e / 4) * 8 + (e & 1))) & 1
                                          : (key <= q) & (q - key < window) & (key < p.len);
                    const bool ok = (c < n) & seen;
                    s[e] = ok ? s[e] : -INFINITY;
                }
            }
            // Column data once per column pair (float2), shared by the thread's two rows.
#pragma unroll
            for (int nb = 0; nb < BQT / 8; ++nb) {
                const float2 ls = *reinterpret_cast<const float2*>(&tlse[st][nb * 8 + (lane % 4) * 2]);
                const float nl[2] = {-ls.x * 1.4426950408889634f, -ls.y * 1.4426950408889634f};
#pragma unroll
                for (int e = 4 * nb; e < 4 * nb + 4; ++e) s[e] = ex2(fmaf(s[e], scale2, nl[e & 1]));
            }
            accumulate<D, BQT>(dv_acc, s, sdo);
#pragma unroll
            for (int nb = 0; nb < BQT / 8; ++nb) {
                const float2 dl = *reinterpret_cast<const float2*>(&tdl[st][nb * 8 + (lane % 4) * 2]);
#pragma unroll
                for (int e = 4 * nb; e < 4 * nb + 4; ++e) s[e] *= dp[e] - ((e & 1) ? dl.y : dl.x);
            }
            accumulate<D, BQT>(dk_acc, s, sq);
        }
        if (lane == 0) bar_arrive(empty(st));
    });
    store_rows<D>(dv_acc, p.dv + kvbase * D, key_row, p.len, 1.f);
    store_rows<D>(dk_acc, p.out + kvbase * D, key_row, p.len, p.scale);
#endif
}

// Rows of a and b ([B, H, L, D] bf16, as 16-byte chunks, `row_chunks` a row) in list order:
// row r of (b, h) is the row at position qpos[b, h, r]. One thread per chunk, each position
// read once per row's chunk (gathering by an index per element reads 8 bytes for every 2 moved).
__global__ void list_rows_kernel(const uint4* a, const uint4* b, const int* qpos, int len, int row_chunks,
                                 int64_t chunks, uint4* a_list, uint4* b_list) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    const int64_t row = i / row_chunks;
    const int64_t src = (row - row % len + qpos[row]) * row_chunks + i % row_chunks;
    a_list[i] = a[src];
    b_list[i] = b[src];
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder, found through the runtime (so the library needs no libcuda link).
EncodeTiled encoder() {
    static EncodeTiled fn = [] {
        void* f = nullptr;
        cudaDriverEntryPointQueryResult found;
        C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
        TORCH_CHECK(found == cudaDriverEntryPointSuccess && f, "cuTensorMapEncodeTiled is not available");
        return reinterpret_cast<EncodeTiled>(f);
    }();
    return fn;
}

// A [rows x D] bf16 matrix read in boxes of [box_rows x 64], swizzled as the kernel's tiles.
CUtensorMap tensor_map(const at::Tensor& t, int box_rows) {
    const int64_t d = t.size(-1);
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)d, (cuuint64_t)(t.numel() / d)};
    const cuuint64_t strides[1] = {(cuuint64_t)d * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    const cuuint32_t elem[2] = {1, 1};
    const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), dims, strides, box, elem,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with error ", (int)r);
    return map;
}


Params make_params(const at::Tensor& q, const at::Tensor& k, const QueryList& list, int64_t window, at::Tensor& out) {
    Params a{};
    static_cast<ListShape&>(a) = list_shape(q, k, list, window);
    a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    return a;
}

template <int D, int BK, bool DQ, bool FAR = false>
void launch(const at::Tensor& q, const at::Tensor& dout, const at::Tensor& k, const at::Tensor& v, Params a) {
    constexpr int stages = BK == 64 ? 3 : 2;
    a.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
    a.dout = reinterpret_cast<const __nv_bfloat16*>(dout.data_ptr());
    const CUtensorMap tq = tensor_map(q, BQ), tdo = tensor_map(dout, BQ), tk = tensor_map(k, BK),
                      tv = tensor_map(v, BK);
    const dim3 grid(q.size(0) * a.heads, (a.lq + BQ - 1) / BQ);
    // Q (and dO), the stages of K and V, and room to round the start up to 1024 bytes.
    const size_t smem = (size_t)((DQ ? 2 : 1) * BQ + 2 * stages * BK) * D * 2 + 1024;
    auto kernel = list_kernel<D, BK, DQ, FAR>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    // Left to choose, the driver configured shared memory for one block (measured: 102 KB).
    if (list_blocks<D, BK, DQ>() > 1)
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            (int)cudaSharedmemCarveoutMaxShared));
    kernel<<<grid, THREADS, smem, at::cuda::getCurrentCUDAStream()>>>(tq, tdo, tk, tv, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void sm90_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
                  at::Tensor& out, at::Tensor& lse) {
    Params a = make_params(q, k, list, window, out);
    a.lse = lse.data_ptr<float>();
    // Wide windows and full prefixes take 128-key tiles (measured: 4% faster at w = 1024 and 8%
    // with 90% of queries skipped, L = 16384, D = 128); narrow windows 64 (13% faster at w = 256).
    // A routed list's full-prefix rows do most of its work (measured: 0.50 ms against 0.54 with
    // 64-key tiles, 10% on the full prefix, w = 256, L = 16384, D = 128).
    // PPA takes 64 where its far distances lie more than a 128-key tile apart on average: the
    // walk skips the far tiles no pair of which is seen, and a tile holding a single far
    // distance is mostly masked. Closer, nearly every tile is seen and 128 is faster (measured
    // at D = 128, w = 64, results/bench/v8/ppa_key_tiles: p = 0.75 10-17% at L = 4096-32768,
    // p = 0.5 9-10% at 4096-8192 and even at 16384, where the mean gap is 136; p = 0.25 takes
    // 19-28% longer).
    if (list.far) {
        const bool dense = (int64_t)a.len - a.window < 128 * list.far_count;
        if (q.size(3) == 64) dense ? launch<64, 128, false, true>(q, q, k, v, a) : launch<64, 64, false, true>(q, q, k, v, a);
        else dense ? launch<128, 128, false, true>(q, q, k, v, a) : launch<128, 64, false, true>(q, q, k, v, a);
        return;
    }
    // At head_dim 64 a window shorter than the sequence keeps 64-key tiles even when wide: they
    // run two blocks an SM (list_blocks), 128-key tiles one (measured: w = 1024 forward 0.214
    // against 0.259 ms at L = 16384, 0.433 against 0.521 at 32768; full prefixes stay on 128,
    // 90% sparse queries 0.170 against 0.270 ms: PERFORMANCE.md, the fused dK/dV entry).
    const bool full_prefix = list.nfull || window >= a.len;
    const bool wide = full_prefix || (window > 512 && q.size(3) == 128);
    if (q.size(3) == 64) wide ? launch<64, 128, false>(q, q, k, v, a) : launch<64, 64, false>(q, q, k, v, a);
    else wide ? launch<128, 128, false>(q, q, k, v, a) : launch<128, 64, false>(q, q, k, v, a);
}

void sm90_dq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
             const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq) {
    Params a = make_params(q, k, list, window, dq);
    a.lse_in = lse.data_ptr<float>();
    a.delta = delta.data_ptr<float>();
    by_far(list.far, [&](auto far) {
        if (q.size(3) == 64) launch<64, 64, true, far()>(q, dout, k, v, a);
        else launch<128, 64, true, far()>(q, dout, k, v, a);
    });
}

void sm90_dkdv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
               const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dk, at::Tensor& dv) {
    // The tensor copies stream Q and dO tiles in list order: a list at positions gets
    // list-ordered copies first.
    QueryList in_order = list;
    in_order.at_positions = false;
    at::Tensor ql = q, dol = dout;
    if (list.at_positions && q.numel() > 0) {
        // A list at positions holds every position: as many rows as keys (list_rows_kernel).
        TORCH_CHECK(q.size(2) == k.size(2), "a list at positions needs as many queries as keys");
        ql = at::empty_like(q), dol = at::empty_like(dout);
        const int64_t chunks = q.numel() / 8;
        constexpr int threads = 256;
        list_rows_kernel<<<(chunks + threads - 1) / threads, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
            reinterpret_cast<const uint4*>(q.data_ptr()), reinterpret_cast<const uint4*>(dout.data_ptr()),
            list.qpos->data_ptr<int>(), (int)q.size(2), (int)q.size(3) / 8, chunks,
            reinterpret_cast<uint4*>(ql.data_ptr()), reinterpret_cast<uint4*>(dol.data_ptr()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    Params a = make_params(ql, k, in_order, window, dk);
    a.dv = reinterpret_cast<__nv_bfloat16*>(dv.data_ptr());
    a.lse_in = lse.data_ptr<float>();
    a.delta = delta.data_ptr<float>();
    const int d = (int)q.size(3);
    const CUtensorMap tq = tensor_map(ql, BQT), tdo = tensor_map(dol, BQT), tk = tensor_map(k, BKEYS),
                      tv = tensor_map(v, BKEYS);
    const dim3 grid(k.size(0) * a.kv_heads, (a.len + BKEYS - 1) / BKEYS);
    // K, V, three stages of Q and dO, the query ranges of the group's heads (two groups of rows
    // each), and room to round the start up to 1024 bytes.
    const size_t smem = (size_t)(2 * BKEYS + 3 * 2 * BQT) * d * 2 + 16 * (a.heads / a.kv_heads) + 1024;
    auto run = [&](auto kernel) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kernel<<<grid, KV_THREADS, smem, at::cuda::getCurrentCUDAStream()>>>(tq, tdo, tk, tv, a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    by_far(list.far, [&](auto far) {
        if (d == 64) run(kv_kernel<64, far()>);
        else run(kv_kernel<128, far()>);
    });
}

}  // namespace attnsweep
