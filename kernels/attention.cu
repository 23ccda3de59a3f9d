// Attention over a list of queries, each seeing the keys of a causal window:
// query r of (batch b, head h) sits at position pos(r) and attends keys k with
//     k <= pos(r)  and  pos(r) - k < window
// (window >= L is full causal attention). The query list is either every position (dense:
// sliding-window attention that does work only inside the band) or a compacted, ascending
// list of positions with a per-(b, h) count (sparse-query attention, L2A Algorithm 1, with
// lists per (batch, head) so per-head routing can use it too). A routed list (AHA) holds
// both paths: its first nfull rows see their whole prefix (window = infinity), the others
// their window, each group ascending (attention.cuh, QueryList).
//
// FlashAttention-2 structure on mma.sync m16n8k16 (bf16 in, fp32 accumulate): a block owns
// 64 queries (4 warps x 16 rows), streams 64-key tiles through shared memory, and keeps the
// running max, sum and output in registers. Only the key tiles a block's queries can see are
// visited, so the work is the band (dense) or the active queries' prefixes (sparse).
// Backward recomputes P from the saved log-sum-exp: one kernel for dQ (query tiles outer),
// one for dK and dV (key tiles outer, over the query heads that share a KV head), no atomics.

#include "attention.cuh"
#include "common.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cstdlib>

namespace attnsweep {
namespace {

constexpr int BQ = 64;      // queries per block
constexpr int BK = 64;      // keys per tile
constexpr int WARPS = 4;    // 16 query (or key) rows each
constexpr int THREADS = WARPS * 32;
constexpr int PAD = 8;      // bf16 elements of row padding against bank conflicts

// Four 8x8 b16 matrices from shared memory; lane l supplies the address of row l % 8 of
// matrix l / 8, and receives (row l / 4, columns 2 (l % 4) and +1) of each (transposed: the
// matrices are read column-wise).
__device__ __forceinline__ void ldsm4(uint32_t* r, const __nv_bfloat16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4_t(uint32_t* r, const __nv_bfloat16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// D = A (16x16, row) * B (16x8, col) + D; fragments as PTX ISA "mma.m16n8k16" lays them out.
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragment: rows [row0, row0+16), columns [col0, col0+16) of a row-major smem tile.
__device__ __forceinline__ void load_a(uint32_t* a, const __nv_bfloat16* tile, int stride, int row0, int col0, int lane) {
    ldsm4(a, tile + (row0 + lane % 16) * stride + col0 + (lane / 16) * 8);
}

// B fragments of two adjacent 8-column blocks n0, n0+8 for k in [k0, k0+16), from a tile that
// stores B transposed (row n holds column n of B, as K holds K^T's columns): b = {b0, b1} of
// block n0, then of block n0+8.
__device__ __forceinline__ void load_b_nk(uint32_t* b, const __nv_bfloat16* tile, int stride, int n0, int k0, int lane) {
    ldsm4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * stride + k0 + ((lane / 8) % 2) * 8);
}

// The same from a tile that stores B as is (row k, column n), as V does for P V.
__device__ __forceinline__ void load_b_kn(uint32_t* b, const __nv_bfloat16* tile, int stride, int k0, int n0, int lane) {
    ldsm4_t(b, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * stride + n0 + (lane / 16) * 8);
}

// The A fragment for k-step j (16 columns) from an accumulator tile of 8-column blocks:
// the accumulator layout of blocks 2j and 2j+1 is the A layout (FlashAttention-2's trick).
__device__ __forceinline__ void acc_to_a(uint32_t* a, const float (*acc)[4], int j) {
    a[0] = pack_bf16(acc[2 * j][0], acc[2 * j][1]);
    a[1] = pack_bf16(acc[2 * j][2], acc[2 * j][3]);
    a[2] = pack_bf16(acc[2 * j + 1][0], acc[2 * j + 1][1]);
    a[3] = pack_bf16(acc[2 * j + 1][2], acc[2 * j + 1][3]);
}

// Starts copying rows [row0, row0 + 64) of a [rows x D] bf16 matrix into smem (zeros past
// `rows`), 16 bytes per cp.async; completes at the matching wait. Row r comes from row at[r]
// where at is given.
template <int D>
__device__ __forceinline__ void load_tile(__nv_bfloat16* dst, const __nv_bfloat16* src, int row0, int rows,
                                          const int* at = nullptr) {
    constexpr int VEC = 8;  // bf16 per 16 bytes
    constexpr int PER_ROW = D / VEC;
    for (int i = threadIdx.x; i < 64 * PER_ROW; i += THREADS) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * VEC;
        const bool in = row0 + r < rows;
        const __nv_bfloat16* g = in ? src + (int64_t)(at ? at[row0 + r] : row0 + r) * D + c : src;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst + r * (D + PAD) + c)), "l"(g),
                     "r"(in ? 16 : 0));
    }
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void wait_loads() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Where load_tile finds list row r's q or dO row (out_row's map as a row table).
__device__ __forceinline__ const int* rows_at(const ListShape& p, int64_t qbase) {
    return p.at_positions ? p.qpos + qbase : nullptr;
}

struct Args : ListShape {
    const __nv_bfloat16 *q, *k, *v, *o, *dout;
    __nv_bfloat16 *out, *dq, *dk, *dv;
    float *lse;
    const float *lse_in, *delta;
};

// Three blocks per SM (the kernel is latency-bound at two): at most 170 registers, and the
// Q tile borrows the second key/value stage, which the first prefetch only overwrites after
// Q has moved to registers, so shared memory holds just the two stages.
template <int D, bool FAR>
__global__ void __launch_bounds__(THREADS, 3) forward_kernel(Args p) {
    const FarView<FAR> fv(p);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr int S = D + PAD;
    __nv_bfloat16* skv = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // two stages of (K tile, V tile)
    __nv_bfloat16* sq = skv + 2 * BK * S;  // = the second stage
    __shared__ int spos[BQ];

    const auto [bh, b, h, kvh, nq, full, row0, qbase] = query_tile(p, blockIdx.y, blockIdx.x, gridDim.x, BQ);
    if (row0 >= nq) {
        zero_rows<D>(p, p.out, p.lse, qbase, row0, BQ);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    load_positions<BQ>(spos, p.qpos, qbase, row0, 0, nq);
    load_tile<D>(sq, p.q + qbase * D, row0, p.lq, rows_at(p, qbase));
    commit();
    __syncthreads();
    const int last = min(row0 + BQ, nq) - 1 - row0;
    const RowSpan span = row_span(spos, 0, last, full - row0, p.window, p.len);
    const int t_first = first_tile(fv, span, BK), t_last = span.key_hi / BK;
    const __nv_bfloat16* kb = p.k + (int64_t)(b * p.kv_heads + kvh) * p.len * D;
    const __nv_bfloat16* vb = p.v + (int64_t)(b * p.kv_heads + kvh) * p.len * D;
    auto stage = [&](int i) { return skv + (i % 2) * 2 * BK * S; };
    load_tile<D>(stage(0), kb, t_first * BK, p.len);
    load_tile<D>(stage(0) + BK * S, vb, t_first * BK, p.len);
    commit();
    wait_loads<1>();  // the Q tile
    __syncthreads();

    uint32_t qa[D / 16][4];
    for (int kk = 0; kk < D / 16; ++kk) load_a(qa[kk], sq, S, warp * 16, kk * 16, lane);
    __syncthreads();  // every warp has its Q fragments: stage 1 is free for the first prefetch
    const int r_lo = warp * 16 + lane / 4;
    const int pos_row[2] = {spos[r_lo], spos[r_lo + 8]};
    // The window of this thread's row hr (r_lo + 8 hr), from one register: the forward at
    // D = 128 is at its 3-blocks-per-SM register limit, and a window register per row spills.
    const int nfull_here = full - row0 - r_lo;
    auto win_row = [&](int hr) { return row_window(8 * hr, nfull_here, p.window); };
    // Scores in log2 units, so exp2 replaces exp.
    const float scale2 = p.scale * 1.4426950408889634f;

    float o_acc[D / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    int visited = 0;  // PPA's stage count; other walks visit consecutive tiles
    for (int t = t_first, t_next; t <= t_last; t = t_next) {
        const int i = FAR ? visited++ : t - t_first;
        t_next = next_tile(fv, t, span, BK);
        if (t_next <= t_last) {
            // Prefetch the next key and value tiles while this one is computed.
            load_tile<D>(stage(i + 1), kb, t_next * BK, p.len);
            load_tile<D>(stage(i + 1) + BK * S, vb, t_next * BK, p.len);
            commit();
            wait_loads<1>();
        } else {
            wait_loads<0>();
        }
        __syncthreads();
        const __nv_bfloat16* sk = stage(i);
        const __nv_bfloat16* sv = sk + BK * S;
        const int k0 = t * BK;
        float s[BK / 8][4] = {};
        for (int kk = 0; kk < D / 16; ++kk)
            for (int nb = 0; nb < BK / 8; nb += 2) {
                uint32_t kf[4];
                load_b_nk(kf, sk, S, nb * 8, kk * 16, lane);
                mma16816(s[nb], qa[kk], kf[0], kf[1]);
                mma16816(s[nb + 1], qa[kk], kf[2], kf[3]);
            }
        // Tiles wholly inside every row's window need no mask.
        const bool interior = k0 + BK - 1 <= pos_row[0] && k0 + BK - 1 <= pos_row[1] &&
                              pos_row[0] - k0 < win_row(0) && pos_row[1] - k0 < win_row(1) && k0 + BK <= p.len;
        // PPA's far bits of this thread's rows (as in dq_kernel).
        const uint64_t far[2] = {far_bits64(fv, pos_row[0] - k0 - (lane % 4) * 2 - (BK - 1)),
                                 far_bits64(fv, pos_row[1] - k0 - (lane % 4) * 2 - (BK - 1))};
        float mx[2] = {-INFINITY, -INFINITY};
        for (int nb = 0; nb < BK / 8; ++nb)
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nb * 8 + (lane % 4) * 2 + (e & 1);
                const int hr = e >> 1;
                const bool ok = interior || visible(key, pos_row[hr], win_row(hr), p.len) ||
                                ((far[hr] >> (BK - 1 - nb * 8 - (e & 1))) & 1);
                s[nb][e] = ok ? s[nb][e] * scale2 : -INFINITY;
                mx[hr] = fmaxf(mx[hr], s[nb][e]);
            }
        float corr[2];
        for (int hr = 0; hr < 2; ++hr) {
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffff, mx[hr], 1));
            mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffff, mx[hr], 2));
            const float m_new = fmaxf(m[hr], mx[hr]);
            // A row that has seen no key yet keeps m = -inf; subtracting 0 keeps exp finite.
            const float base = m_new == -INFINITY ? 0.f : m_new;
            corr[hr] = exp2f(m[hr] - base);
            m[hr] = m_new;
            float sum = 0.f;
            for (int nb = 0; nb < BK / 8; ++nb)
                for (int e = hr * 2; e < hr * 2 + 2; ++e) {
                    s[nb][e] = exp2f(s[nb][e] - base);
                    sum += s[nb][e];
                }
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            l[hr] = l[hr] * corr[hr] + sum;
        }
        for (int nb = 0; nb < D / 8; ++nb) {
            o_acc[nb][0] *= corr[0];
            o_acc[nb][1] *= corr[0];
            o_acc[nb][2] *= corr[1];
            o_acc[nb][3] *= corr[1];
        }
        for (int j = 0; j < BK / 16; ++j) {
            uint32_t pa[4];
            acc_to_a(pa, s, j);
            for (int nb = 0; nb < D / 8; nb += 2) {
                uint32_t vf[4];
                load_b_kn(vf, sv, S, j * 16, nb * 8, lane);
                mma16816(o_acc[nb], pa, vf[0], vf[1]);
                mma16816(o_acc[nb + 1], pa, vf[2], vf[3]);
            }
        }
        // The next prefetch overwrites the other stage; this one must be finished by all.
        __syncthreads();
    }
    for (int hr = 0; hr < 2; ++hr) {
        const int r = row0 + r_lo + hr * 8;
        if (r >= p.lq) continue;
        const bool ok = pos_row[hr] >= 0;
        const float inv = ok ? 1.f / l[hr] : 0.f;
        __nv_bfloat16* orow = p.out + out_row(p, qbase, r) * D;
        for (int nb = 0; nb < D / 8; ++nb) {
            const int c = nb * 8 + (lane % 4) * 2;
            *reinterpret_cast<__nv_bfloat162*>(orow + c) =
                __floats2bfloat162_rn(o_acc[nb][hr * 2] * inv, o_acc[nb][hr * 2 + 1] * inv);
        }
        // Natural-log log-sum-exp of the scaled scores, which backward recomputes P from.
        if (lane % 4 == 0) p.lse[qbase + r] = ok ? (m[hr] + __log2f(l[hr])) * 0.6931471805599453f : -INFINITY;
    }
}

// dQ = scale * sum_k dS K with dS = P (dP - delta), dP = dO V^T: query tiles outer.
template <int D, bool FAR>
__global__ void __launch_bounds__(THREADS) dq_kernel(Args p) {
    const FarView<FAR> fv(p);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* sq = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    __nv_bfloat16* sdo = sq + BQ * (D + PAD);
    __nv_bfloat16* sk = sdo + BQ * (D + PAD);
    __nv_bfloat16* sv = sk + BK * (D + PAD);
    __shared__ int spos[BQ];

    const auto [bh, b, h, kvh, nq, full, row0, qbase] = query_tile(p, blockIdx.y, blockIdx.x, gridDim.x, BQ);
    if (row0 >= nq) {
        zero_rows<D>(p, p.dq, nullptr, qbase, row0, BQ);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    load_positions<BQ>(spos, p.qpos, qbase, row0, 0, nq);
    load_tile<D>(sq, p.q + qbase * D, row0, p.lq, rows_at(p, qbase));
    load_tile<D>(sdo, p.dout + qbase * D, row0, p.lq, rows_at(p, qbase));
    commit();
    wait_loads<0>();
    __syncthreads();
    const int last = min(row0 + BQ, nq) - 1 - row0;
    const RowSpan span = row_span(spos, 0, last, full - row0, p.window, p.len);
    uint32_t qa[D / 16][4], da[D / 16][4];
    for (int kk = 0; kk < D / 16; ++kk) {
        load_a(qa[kk], sq, D + PAD, warp * 16, kk * 16, lane);
        load_a(da[kk], sdo, D + PAD, warp * 16, kk * 16, lane);
    }
    const int r_lo = warp * 16 + lane / 4;
    const int pos_row[2] = {spos[r_lo], spos[r_lo + 8]};
    // The window of this thread's row hr, from one register (as in forward_kernel).
    const int nfull_here = full - row0 - r_lo;
    auto win_row = [&](int hr) { return row_window(8 * hr, nfull_here, p.window); };
    float lse[2], dl[2];
    for (int hr = 0; hr < 2; ++hr) {
        const int r = min(row0 + r_lo + hr * 8, p.lq - 1);
        lse[hr] = p.lse_in[qbase + r];
        dl[hr] = p.delta[qbase + r];
    }
    float dq_acc[D / 8][4] = {};
    const __nv_bfloat16* kb = p.k + (int64_t)(b * p.kv_heads + kvh) * p.len * D;
    const __nv_bfloat16* vb = p.v + (int64_t)(b * p.kv_heads + kvh) * p.len * D;
    for (int t = first_tile(fv, span, BK); t <= span.key_hi / BK; t = next_tile(fv, t, span, BK)) {
        const int k0 = t * BK;
        __syncthreads();
        load_tile<D>(sk, kb, k0, p.len);
        load_tile<D>(sv, vb, k0, p.len);
        commit();
        wait_loads<0>();
        __syncthreads();
        float s[BK / 8][4] = {}, dp[BK / 8][4] = {};
        for (int kk = 0; kk < D / 16; ++kk)
            for (int nb = 0; nb < BK / 8; nb += 2) {
                uint32_t kf[4], vf[4];
                load_b_nk(kf, sk, D + PAD, nb * 8, kk * 16, lane);
                load_b_nk(vf, sv, D + PAD, nb * 8, kk * 16, lane);
                mma16816(s[nb], qa[kk], kf[0], kf[1]);
                mma16816(s[nb + 1], qa[kk], kf[2], kf[3]);
                mma16816(dp[nb], da[kk], vf[0], vf[1]);
                mma16816(dp[nb + 1], da[kk], vf[2], vf[3]);
            }
        // PPA's far bits of this thread's rows: bit i of far[hr] is the distance from its row to
        // column k0 + 2 (lane % 4) + BK - 1 - i.
        const uint64_t far[2] = {far_bits64(fv, pos_row[0] - k0 - (lane % 4) * 2 - (BK - 1)),
                                 far_bits64(fv, pos_row[1] - k0 - (lane % 4) * 2 - (BK - 1))};
        for (int nb = 0; nb < BK / 8; ++nb)
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nb * 8 + (lane % 4) * 2 + (e & 1), hr = e >> 1;
                const bool ok = visible(key, pos_row[hr], win_row(hr), p.len) ||
                                ((far[hr] >> (BK - 1 - nb * 8 - (e & 1))) & 1);
                const float pr = ok ? __expf(s[nb][e] * p.scale - lse[hr]) : 0.f;
                s[nb][e] = pr * (dp[nb][e] - dl[hr]);  // dS
            }
        for (int j = 0; j < BK / 16; ++j) {
            uint32_t a[4];
            acc_to_a(a, s, j);
            for (int nb = 0; nb < D / 8; nb += 2) {
                uint32_t kf[4];
                load_b_kn(kf, sk, D + PAD, j * 16, nb * 8, lane);
                mma16816(dq_acc[nb], a, kf[0], kf[1]);
                mma16816(dq_acc[nb + 1], a, kf[2], kf[3]);
            }
        }
    }
    for (int hr = 0; hr < 2; ++hr) {
        const int r = row0 + r_lo + hr * 8;
        if (r >= p.lq) continue;
        const float f = pos_row[hr] >= 0 ? p.scale : 0.f;
        __nv_bfloat16* row = p.dq + out_row(p, qbase, r) * D;
        for (int nb = 0; nb < D / 8; ++nb)
            *reinterpret_cast<__nv_bfloat162*>(row + nb * 8 + (lane % 4) * 2) =
                __floats2bfloat162_rn(dq_acc[nb][hr * 2] * f, dq_acc[nb][hr * 2 + 1] * f);
    }
}

// dV = sum_q P^T dO and dK = scale * sum_q dS^T Q: key tiles outer, over every query head
// of the KV head's group and, in each of its list's two groups (full-prefix rows, window
// rows), the query tiles that can see the keys.
template <int D, bool FAR>
__global__ void __launch_bounds__(THREADS) dkdv_kernel(Args p) {
    const FarView<FAR> fv(p);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* sk = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    __nv_bfloat16* sv = sk + BK * (D + PAD);
    __nv_bfloat16* sq = sv + BK * (D + PAD);
    __nv_bfloat16* sdo = sq + BQ * (D + PAD);
    __shared__ int spos[BQ];
    __shared__ float slse[BQ], sdl[BQ];
    __shared__ int srange[2];

    const int bkv = blockIdx.y, b = bkv / p.kv_heads, kvh = bkv % p.kv_heads;
    const int group = p.heads / p.kv_heads;
    const int k0 = blockIdx.x * BK;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t kvbase = (int64_t)bkv * p.len;
    load_tile<D>(sk, p.k + kvbase * D, k0, p.len);
    load_tile<D>(sv, p.v + kvbase * D, k0, p.len);
    commit();
    wait_loads<0>();
    const int key_row[2] = {k0 + warp * 16 + lane / 4, k0 + warp * 16 + lane / 4 + 8};
    float dk_acc[D / 8][4] = {}, dv_acc[D / 8][4] = {};
    for (int gs = 0; gs < 2 * group; ++gs) {
        const int h = kvh * group + gs / 2, bh = b * p.heads + h;
        const int nq = p.nq ? p.nq[bh] : p.lq;
        const auto [lo, hi, window] = row_group(gs % 2, nq, p.nfull ? p.nfull[bh] : 0, p.window);
        if (lo >= hi) continue;
        const int64_t qbase = (int64_t)bh * p.lq;
        if (threadIdx.x == 0) {
            // Queries that can see a key of this tile: positions in [k0, k0 + BK - 1 + window - 1]
            // (PPA: from k0 on).
            srange[0] = lo + first_at_or_after(p.qpos, qbase + lo, hi - lo, k0);
            const int64_t last = FAR ? INT32_MAX : (int64_t)k0 + BK - 1 + window;  // exclusive bound on positions
            srange[1] = lo + first_at_or_after(p.qpos, qbase + lo, hi - lo, last < INT32_MAX ? (int)last : INT32_MAX);
        }
        __syncthreads();
        const int r_begin = (srange[0] / BQ) * BQ, r_end = srange[1];
        for (int row0 = seen_rows_from(fv, r_begin, r_end, k0, BK, BQ); row0 < r_end;
             row0 = seen_rows_from(fv, row0 + BQ, r_end, k0, BK, BQ)) {
            __syncthreads();
            load_positions<BQ>(spos, p.qpos, qbase, row0, lo, hi);
            for (int i = threadIdx.x; i < BQ; i += THREADS) {
                const int r = min(row0 + i, p.lq - 1);
                slse[i] = p.lse_in[qbase + r];
                sdl[i] = p.delta[qbase + r];
            }
            load_tile<D>(sq, p.q + qbase * D, row0, p.lq, rows_at(p, qbase));
            load_tile<D>(sdo, p.dout + qbase * D, row0, p.lq, rows_at(p, qbase));
            commit();
            wait_loads<0>();
            __syncthreads();
            // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries per warp.
            float st[BQ / 8][4] = {}, dpt[BQ / 8][4] = {};
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t ka[4], va[4];
                load_a(ka, sk, D + PAD, warp * 16, kk * 16, lane);
                load_a(va, sv, D + PAD, warp * 16, kk * 16, lane);
                for (int nb = 0; nb < BQ / 8; nb += 2) {
                    uint32_t qf[4], df[4];
                    load_b_nk(qf, sq, D + PAD, nb * 8, kk * 16, lane);
                    load_b_nk(df, sdo, D + PAD, nb * 8, kk * 16, lane);
                    mma16816(st[nb], ka, qf[0], qf[1]);
                    mma16816(st[nb + 1], ka, qf[2], qf[3]);
                    mma16816(dpt[nb], va, df[0], df[1]);
                    mma16816(dpt[nb + 1], va, df[2], df[3]);
                }
            }
            // PPA's far bits (dense lists: row qi at row0 + qi): bit i of far[hr] is the
            // distance from key_row[hr] to the query row0 + 2 (lane % 4) + i.
            const uint64_t far[2] = {far_bits64(fv, row0 + (lane % 4) * 2 - key_row[0]),
                                     far_bits64(fv, row0 + (lane % 4) * 2 - key_row[1])};
            for (int nb = 0; nb < BQ / 8; ++nb)
                for (int e = 0; e < 4; ++e) {
                    const int qi = nb * 8 + (lane % 4) * 2 + (e & 1), hr = e >> 1;
                    const bool ok = visible(key_row[hr], spos[qi], window, p.len) ||
                                    (spos[qi] >= 0 && ((far[hr] >> (nb * 8 + (e & 1))) & 1));
                    const float pr = ok ? __expf(st[nb][e] * p.scale - slse[qi]) : 0.f;
                    st[nb][e] = pr;                         // P^T
                    dpt[nb][e] = pr * (dpt[nb][e] - sdl[qi]);  // dS^T
                }
            for (int j = 0; j < BQ / 16; ++j) {
                uint32_t pa[4], sa[4];
                acc_to_a(pa, st, j);
                acc_to_a(sa, dpt, j);
                for (int nb = 0; nb < D / 8; nb += 2) {
                    uint32_t df[4], qf[4];
                    load_b_kn(df, sdo, D + PAD, j * 16, nb * 8, lane);
                    load_b_kn(qf, sq, D + PAD, j * 16, nb * 8, lane);
                    mma16816(dv_acc[nb], pa, df[0], df[1]);
                    mma16816(dv_acc[nb + 1], pa, df[2], df[3]);
                    mma16816(dk_acc[nb], sa, qf[0], qf[1]);
                    mma16816(dk_acc[nb + 1], sa, qf[2], qf[3]);
                }
            }
        }
        __syncthreads();
    }
    for (int hr = 0; hr < 2; ++hr) {
        const int key = key_row[hr];
        if (key >= p.len) continue;
        for (int nb = 0; nb < D / 8; ++nb) {
            const int c = nb * 8 + (lane % 4) * 2;
            *reinterpret_cast<__nv_bfloat162*>(p.dk + (kvbase + key) * D + c) =
                __floats2bfloat162_rn(dk_acc[nb][hr * 2] * p.scale, dk_acc[nb][hr * 2 + 1] * p.scale);
            *reinterpret_cast<__nv_bfloat162*>(p.dv + (kvbase + key) * D + c) =
                __floats2bfloat162_rn(dv_acc[nb][hr * 2], dv_acc[nb][hr * 2 + 1]);
        }
    }
}

template <typename Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, const Args& a) {
    if (smem > 48 * 1024) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    kernel<<<grid, THREADS, smem, at::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Args make_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window) {
    Args a{};
    static_cast<ListShape&>(a) = list_shape(q, k, list, window);
    a.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
    a.k = reinterpret_cast<const __nv_bfloat16*>(k.data_ptr());
    a.v = reinterpret_cast<const __nv_bfloat16*>(v.data_ptr());
    return a;
}

// The backward's inputs and outputs in a.
void bind_backward(Args& a, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv) {
    a.lse_in = lse.data_ptr<float>();
    a.delta = delta.data_ptr<float>();
    a.dout = reinterpret_cast<const __nv_bfloat16*>(dout.data_ptr());
    a.dq = reinterpret_cast<__nv_bfloat16*>(dq.data_ptr());
    a.dk = reinterpret_cast<__nv_bfloat16*>(dk.data_ptr());
    a.dv = reinterpret_cast<__nv_bfloat16*>(dv.data_ptr());
}

// Whether to run the wgmma kernels (attention_sm90.cu): on compute capability 9.0, in a library
// built for sm_90a, unless ATTNSWEEP_PORTABLE_KERNELS=1 keeps Hopper on the mma.sync kernels
// (to compare the two).
bool use_sm90() {
#ifdef ATTNSWEEP_SM90A
    static const bool portable = std::getenv("ATTNSWEEP_PORTABLE_KERNELS") != nullptr;
    return !portable && at::cuda::getCurrentDeviceProperties()->major == 9;
#else
    return false;
#endif
}

// One block per (b, h) sorts its positions into the routed list's three groups with warp
// ballots over chunks of the block's width: a counting pass, then a pass placing each
// position at its group's running offset (no sort, no host synchronisation).
constexpr int ROUTE_THREADS = 1024;
__global__ void __launch_bounds__(ROUTE_THREADS)
    route_kernel(const uint8_t* path, int len, int* perm, int* nq, int* nfull) {
    constexpr int WARPS = ROUTE_THREADS / 32;
    static_assert(WARPS == 32, "warp 0 scans one count per warp");
    // Per chunk: each warp's count, then its exclusive offset; two buffers, so a chunk's writes
    // cannot meet the previous chunk's reads (one barrier fewer per chunk).
    __shared__ int counts[2][3][WARPS];
    __shared__ int totals[3];
    const int bh = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t base = (int64_t)bh * len;
    // Group of a query in list order: 0 full prefix (path 2), 1 window (path 1), 2 no
    // attention (path 0; any other value reads as 0).
    auto group_of = [](uint8_t p) { return p == 2 ? 0 : p == 1 ? 1 : 2; };
    if (threadIdx.x < 3) totals[threadIdx.x] = 0;
    __syncthreads();
    int mine[3] = {0, 0, 0};
    for (int i = threadIdx.x; i < len; i += ROUTE_THREADS) ++mine[group_of(path[base + i])];
    for (int g = 0; g < 3; ++g) {
        for (int o = 16; o; o >>= 1) mine[g] += __shfl_xor_sync(0xffffffffu, mine[g], o);
        if (lane == 0) atomicAdd(&totals[g], mine[g]);
    }
    __syncthreads();
    // Where each group's next position goes (warp 0 keeps it across chunks).
    int start[3] = {0, totals[0], totals[0] + totals[1]};
    // Each chunk's paths are loaded one chunk ahead, so the load overlaps the barriers.
    uint8_t next = threadIdx.x < len ? path[base + threadIdx.x] : 0;
    for (int c0 = 0, buf = 0; c0 < len; c0 += ROUTE_THREADS, buf ^= 1) {
        const int i = c0 + threadIdx.x;
        const int g = i < len ? group_of(next) : 3;
        if (i + ROUTE_THREADS < len) next = path[base + i + ROUTE_THREADS];
        unsigned ballot[3];
        for (int k = 0; k < 3; ++k) ballot[k] = __ballot_sync(0xffffffffu, g == k);
        int(*c)[WARPS] = counts[buf];
        if (lane < 3) c[lane][warp] = __popc(ballot[lane]);
        __syncthreads();
        if (warp == 0) {
            // Exclusive scan of the warps' counts, lane w holding warp w's.
            for (int k = 0; k < 3; ++k) {
                const int n = c[k][lane];
                int incl = n;
                for (int o = 1; o < 32; o <<= 1) {
                    const int x = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += x;
                }
                c[k][lane] = start[k] + incl - n;
                start[k] += __shfl_sync(0xffffffffu, incl, 31);
            }
        }
        __syncthreads();
        if (g < 3) perm[base + c[g][warp] + __popc(ballot[g] & ((1u << lane) - 1))] = i;
    }
    if (threadIdx.x == 0) {
        nq[bh] = totals[0] + totals[1];
        nfull[bh] = totals[0];
    }
}

// One thread per distance d: a binary search of the offsets gives both neighbours, and a warp
// ballot the bits of its 32 distances (the window's among them).
__global__ void far_table_kernel(const int* offsets, int n, int len, int window, int* table) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    int lo = 0, hi = n;  // first offset >= d
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (offsets[mid] < d) lo = mid + 1; else hi = mid;
    }
    const bool far = d < len && lo < n && offsets[lo] == d;
    const unsigned bits = __ballot_sync(0xffffffffu, far || (d < len && d < window));
    if (d % 32 == 0 && d < len) table[d / 32] = (int)bits;
    if (d < len) {
        int* above = table + far_words(len);
        above[d] = lo < n && offsets[lo] < len ? offsets[lo] : INT32_MAX;
        above[(int64_t)len + d] = far ? d : lo > 0 ? offsets[lo - 1] : -1;
    }
}

// AHA's gates (walk.cuh, aha_route) of scores [B, L, H], a thread each: hard [B, L, H] (1 open),
// the paths chosen and other and the gradient factor coef [B, H, L], and the chosen paths'
// pairs added to *pairs. One pass over a [B, L, H] tensor of a few hundred thousand floats,
// where ATen took some fifty launches (the hash alone a dozen int64 passes).
constexpr int GATE_THREADS = 256;
__global__ void __launch_bounds__(GATE_THREADS)
    aha_gates_kernel(const float* s, int64_t n, int len, int heads, AhaGateArgs a, float* hard, uint8_t* chosen,
                     uint8_t* other, float* coef, double* pairs) {
    __shared__ long long warp_pairs[GATE_THREADS / 32];
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    long long mine = 0;
    if (i < n) {
        const int64_t h = i % heads, l = i / heads % len, b = i / heads / len;
        const AhaRoute r = aha_route(a, s[i], b, l, h);
        const int64_t at = (b * heads + h) * len + l;
        hard[i] = r.on ? 1.f : 0.f;
        chosen[at] = r.chosen;
        other[at] = r.other;
        coef[at] = r.coef;
        mine = r.pairs;
    }
    for (int o = 16; o; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
    if (threadIdx.x % 32 == 0) warp_pairs[threadIdx.x / 32] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long sum = 0;
        for (int w = 0; w < GATE_THREADS / 32; ++w) sum += warp_pairs[w];
        // Integer sums below 2^53 are exact in fp64 in any order: the total is deterministic.
        atomicAdd(pairs, (double)sum);
    }
}

// rowsum(a * (b - minus)) in fp32 (minus may be null) of list row i, in D / 8 lanes with one
// 16-byte load of each input a lane; with perm the list's row i is position perm[i] of its
// (b, h). The backward's delta (ops.cpp, row_delta: a = dO, b = O) and the straight-through
// mix's weight gradient (ops.cpp, StraightThroughMix). The products of two bf16 are exact in
// fp32, so a delta differs from the ATen formula's only in the order of the sum.
__global__ void row_dot_kernel(const uint4* a, const uint4* b, const uint4* minus, const int* perm, int lq,
                               int chunks, int64_t rows, float* dot) {
    const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / chunks;
    const int c = threadIdx.x % chunks;
    float sum = 0.f;
    if (i < rows) {
        const int64_t at = (perm ? i - i % lq + perm[i] : i) * chunks + c;
        const uint4 va = a[at], vb = b[at], vm = minus ? minus[at] : uint4{0, 0, 0, 0};
        const auto *x = reinterpret_cast<const __nv_bfloat162*>(&va), *y = reinterpret_cast<const __nv_bfloat162*>(&vb),
                   *z = reinterpret_cast<const __nv_bfloat162*>(&vm);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 fx = __bfloat1622float2(x[j]), fy = __bfloat1622float2(y[j]), fz = __bfloat1622float2(z[j]);
            sum = fmaf(fx.x, fy.x - fz.x, fmaf(fx.y, fy.y - fz.y, sum));
        }
    }
    // The lanes of a row are an aligned group of `chunks` (a power of two dividing 32).
    for (int o = chunks / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (i < rows && c == 0) dot[i] = sum;
}

// AHA's straight-through mix, y = c + w (c - o) with one fp32 weight per row of `chunks`
// 16-byte chunks: one pass instead of ATen's subtract, broadcast multiply and add.
__global__ void st_mix_kernel(const uint4* c, const uint4* o, const float* w, int chunks, int64_t n, uint4* y) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float wr = w[i / chunks];
    const uint4 vc = c[i], vo = o[i];
    uint4 out;
    const auto *x = reinterpret_cast<const __nv_bfloat162*>(&vc), *z = reinterpret_cast<const __nv_bfloat162*>(&vo);
    auto* r = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 fx = __bfloat1622float2(x[j]), fz = __bfloat1622float2(z[j]);
        r[j] = __floats2bfloat162_rn(fmaf(wr, fx.x - fz.x, fx.x), fmaf(wr, fx.y - fz.y, fx.y));
    }
    y[i] = out;
}

// PPA's sparse far distances, pair by pair. Past the distance where consecutive offsets lie
// PPA_PAIR_GAP or more apart (kernels.rs, ppa_pairs_from), a tile holds about one seen pair per
// row in that many columns, and the tile kernels would pay a whole tile for it; here PAIR_LANES
// lanes own a row (a query's; a key's for dK and dV) and gather the rows its far distances pair
// it with from L2, PAIR_UNROLL pairs in flight. No key row is shared by two rows of a group
// (their pairs at one distance are consecutive keys), so shared memory would not cut traffic.
// The forward merges its pairs into the tile pass's (out, lse) by log-sum-exp; the backward
// adds its terms to the tile pass's gradients. Scores are kept in log2 units (exp2).
constexpr int PAIR_LANES = 8;
constexpr int PAIR_THREADS = 128;
constexpr int PAIR_ROWS = PAIR_THREADS / PAIR_LANES;
constexpr int PAIR_UNROLL = 4;
constexpr float LOG2E = 1.4426950408889634f;

// The list kernels' arguments (a dense list: heads, KV heads, length, window, scale and the
// tensors) plus what the pair kernels pair each row with: PPA's far distances (offsets,
// ascending, n of them), or attention sinks (sinks > 0: the sequence's first `sinks` keys,
// paired with the queries that do not see them through their window).
struct PairArgs : Args {
    const int* offsets;
    int n;
    int sinks;
};

// How many sink keys query row i sees beyond its window: keys 0 .. min(sinks, i - window + 1) - 1.
__device__ __forceinline__ int sinks_beyond(const PairArgs& p, int i) {
    return max(0, min(p.sinks, i - p.window + 1));
}

// A lane's D / PAIR_LANES columns of a bf16 row: 16-byte pieces strided by PAIR_LANES, so each
// load instruction reads whole 128-byte lines of a group's row.
template <int D>
struct RowPiece {
    static constexpr int N = D / (8 * PAIR_LANES), E = D / PAIR_LANES;
    uint4 u[N];
    __device__ __forceinline__ void load(const __nv_bfloat16* row, int sub) {
#pragma unroll
        for (int c = 0; c < N; ++c) u[c] = __ldg(reinterpret_cast<const uint4*>(row) + c * PAIR_LANES + sub);
    }
    // f(i, x) for each of the lane's E columns i of the row, x its value in fp32.
    template <typename F>
    __device__ __forceinline__ void each(F f) const {
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const auto* x = reinterpret_cast<const __nv_bfloat162*>(&u[c]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 v = __bfloat1622float2(x[j]);
                f(c * 8 + 2 * j, v.x);
                f(c * 8 + 2 * j + 1, v.y);
            }
        }
    }
    __device__ __forceinline__ void scaled(float b, float* y) const {
        each([&](int i, float x) { y[i] = b * x; });
    }
    __device__ __forceinline__ void axpby(float a, float b, float* y) const {
        each([&](int i, float x) { y[i] = fmaf(b, x, a * y[i]); });
    }
    // The lane's share of row . w.
    __device__ __forceinline__ float dot(const float* w) const {
        float s = 0.f;
        each([&](int i, float x) { s = fmaf(x, w[i], s); });
        return s;
    }
};

// Stores a lane's E columns (RowPiece's layout) of a row as bf16, times `mul`.
template <int D>
__device__ __forceinline__ void store_piece(__nv_bfloat16* row, int sub, const float* y, float mul) {
#pragma unroll
    for (int c = 0; c < RowPiece<D>::N; ++c) {
        uint4 w;
        uint32_t* x = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = pack_bf16(y[c * 8 + 2 * j] * mul, y[c * 8 + 2 * j + 1] * mul);
        reinterpret_cast<uint4*>(row)[c * PAIR_LANES + sub] = w;
    }
}

// The sum of a row's lanes (an aligned group of PAIR_LANES), in each of them.
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = PAIR_LANES / 2; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// How many of the n ascending offsets are at most x.
__device__ __forceinline__ int count_at_most(const int* offsets, int n, int x) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (__ldg(offsets + mid) <= x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// The most pairs of any row of the warp: every lane runs that many, so the shuffles stay
// converged; a row's pairs beyond its own count weigh zero.
__device__ __forceinline__ int warp_trips(int count) {
#pragma unroll
    for (int o = 16; o >= PAIR_LANES; o >>= 1) count = max(count, __shfl_xor_sync(0xffffffffu, count, o));
    return count;
}

// The block's row of this lane's group (highest rows first: a query's far pairs grow with its
// position) and its (b, h) and KV head.
struct PairRow {
    int sub, row, bh, kvh;
    bool ok;
    __device__ PairRow(const PairArgs& p, bool highest_first, int heads) {
        sub = threadIdx.x % PAIR_LANES;
        const int blk = highest_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
        row = blk * PAIR_ROWS + threadIdx.x / PAIR_LANES;
        ok = row < p.len;
        if (!ok) row = 0;  // loads stay in bounds; nothing is written
        bh = blockIdx.y;
        kvh = bh / heads * p.kv_heads + bh % heads / (heads / p.kv_heads);
    }
};

// A query row's pairs (forward and dQ): its far distances, or the sinks beyond its window; how
// many, the warp's trip count, the row's index in [B, H, L], and its KV head's K and V.
template <int D>
struct QueryPairs : PairRow {
    int count, trips;
    int64_t at;
    const __nv_bfloat16 *kb, *vb;
    __device__ explicit QueryPairs(const PairArgs& p) : PairRow(p, true, p.heads) {
        count = !ok ? 0 : p.sinks ? sinks_beyond(p, row) : count_at_most(p.offsets, p.n, row);
        trips = warp_trips(count);
        at = (int64_t)bh * p.len + row;
        kb = p.k + (int64_t)kvh * p.len * D;
        vb = p.v + (int64_t)kvh * p.len * D;
    }
    // The key and value rows of pairs j0, j0 + 1, ... (the row's own past its count: callers
    // weigh those zero): sink j is key j, far distance j key row - offsets[j].
    __device__ __forceinline__ void gather(const PairArgs& p, int j0, RowPiece<D>* kr, RowPiece<D>* vr) const {
#pragma unroll
        for (int u = 0; u < PAIR_UNROLL; ++u) {
            const int j = j0 + u;
            const int key = j >= count ? row : p.sinks ? j : row - __ldg(p.offsets + j);
            kr[u].load(kb + (int64_t)key * D, sub);
            vr[u].load(vb + (int64_t)key * D, sub);
        }
    }
};

// Forward: query row i also sees keys i - offsets[j] (or sinks); its pairs join the tile pass's softmax
// state (m = lse, l = 1, acc = out) and the merged row replaces out and lse.
template <int D>
__global__ void __launch_bounds__(PAIR_THREADS) far_forward_kernel(PairArgs p) {
    constexpr int E = RowPiece<D>::E;
    const QueryPairs<D> r(p);
    if (r.trips == 0) return;
    float qs[E], acc[E];
    RowPiece<D> x;
    x.load(p.q + r.at * D, r.sub);
    x.scaled(p.scale * LOG2E, qs);
    x.load(p.out + r.at * D, r.sub);
    x.scaled(1.f, acc);
    const float lse = p.lse[r.at];
    float m = lse * LOG2E, l = lse == -INFINITY ? 0.f : 1.f;
    for (int j0 = 0; j0 < r.trips; j0 += PAIR_UNROLL) {
        RowPiece<D> kr[PAIR_UNROLL], vr[PAIR_UNROLL];
        r.gather(p, j0, kr, vr);
        float s[PAIR_UNROLL], mx = m;
#pragma unroll
        for (int u = 0; u < PAIR_UNROLL; ++u) {
            s[u] = group_sum(kr[u].dot(qs));
            if (j0 + u >= r.count) s[u] = -INFINITY;
            mx = fmaxf(mx, s[u]);
        }
        const float base = mx == -INFINITY ? 0.f : mx;  // a row with nothing seen yet stays empty
        const float corr = exp2f(m - base);
        m = mx;
#pragma unroll
        for (int u = 0; u < PAIR_UNROLL; ++u) {
            const float pr = exp2f(s[u] - base);
            l = l * (u == 0 ? corr : 1.f) + pr;
            vr[u].axpby(u == 0 ? corr : 1.f, pr, acc);
        }
    }
    if (r.count == 0) return;
    store_piece<D>(p.out + r.at * D, r.sub, acc, 1.f / l);
    if (r.sub == 0) p.lse[r.at] = (m + __log2f(l)) / LOG2E;
}

// dQ: query row i's far pairs, dQ_i += scale sum_j dS_ij k_j with P = exp(s - lse) and
// dS = P (dO . v - delta), added to the tile pass's dQ.
template <int D>
__global__ void __launch_bounds__(PAIR_THREADS) far_dq_kernel(PairArgs p) {
    constexpr int E = RowPiece<D>::E;
    const QueryPairs<D> r(p);
    if (r.trips == 0) return;
    float qs[E], dos[E], dq[E];
    RowPiece<D> x;
    x.load(p.q + r.at * D, r.sub);
    x.scaled(p.scale * LOG2E, qs);
    x.load(p.dout + r.at * D, r.sub);
    x.scaled(1.f, dos);
    for (int e = 0; e < E; ++e) dq[e] = 0.f;
    const float lse2 = p.lse_in[r.at] * LOG2E, delta = p.delta[r.at];
    for (int j0 = 0; j0 < r.trips; j0 += PAIR_UNROLL) {
        RowPiece<D> kr[PAIR_UNROLL], vr[PAIR_UNROLL];
        r.gather(p, j0, kr, vr);
#pragma unroll
        for (int u = 0; u < PAIR_UNROLL; ++u) {
            const float s = group_sum(kr[u].dot(qs)), dp = group_sum(vr[u].dot(dos));
            const float pr = j0 + u < r.count ? exp2f(s - lse2) : 0.f;
            kr[u].axpby(1.f, pr * (dp - delta), dq);
        }
    }
    if (r.count == 0) return;
    x.load(p.dq + r.at * D, r.sub);
    x.axpby(p.scale, 1.f, dq);
    store_piece<D>(p.dq + r.at * D, r.sub, dq, 1.f);
}

// dK and dV: key row k's far pairs are the queries k + offsets[j] of each query head sharing
// its KV head; dK_k += scale sum dS q, dV_k += sum P dO, added to the tile pass's. At D = 128
// bounded to three blocks an SM (240 registers to 168, 24 bytes of spill): 10% faster, the
// loads in flight being what bounds it; D = 64 runs three at 140 without the bound, which
// measured 3% slower with it (PERFORMANCE.md, "PPA's sparse far distances pair by pair").
template <int D>
__global__ void __launch_bounds__(PAIR_THREADS, D == 128 ? 3 : 1) far_dkdv_kernel(PairArgs p) {
    constexpr int E = RowPiece<D>::E;
    const PairRow r(p, false, p.kv_heads);  // lowest keys first: they have the most pairs
    const int count = r.ok ? count_at_most(p.offsets, p.n, p.len - 1 - r.row) : 0;
    const int trips = warp_trips(count);
    if (trips == 0) return;
    const int64_t at = (int64_t)r.bh * p.len + r.row;  // r.bh: the (b, KV head) here
    float ks[E], vs[E], dk[E], dv[E];
    RowPiece<D> x;
    x.load(p.k + at * D, r.sub);
    x.scaled(p.scale * LOG2E, ks);
    x.load(p.v + at * D, r.sub);
    x.scaled(1.f, vs);
    for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0.f;
    const int group = p.heads / p.kv_heads;
    for (int g = 0; g < group; ++g) {
        const int64_t qh = (int64_t)(r.bh / p.kv_heads * p.heads + r.bh % p.kv_heads * group + g) * p.len;
        for (int j0 = 0; j0 < trips; j0 += PAIR_UNROLL) {
            RowPiece<D> qr[PAIR_UNROLL], dr[PAIR_UNROLL];
            float lse2[PAIR_UNROLL], delta[PAIR_UNROLL];
#pragma unroll
            for (int u = 0; u < PAIR_UNROLL; ++u) {
                const int64_t qi = qh + (j0 + u < count ? r.row + __ldg(p.offsets + j0 + u) : r.row);
                qr[u].load(p.q + qi * D, r.sub);
                dr[u].load(p.dout + qi * D, r.sub);
                lse2[u] = p.lse_in[qi] * LOG2E;
                delta[u] = p.delta[qi];
            }
#pragma unroll
            for (int u = 0; u < PAIR_UNROLL; ++u) {
                const float s = group_sum(qr[u].dot(ks)), dp = group_sum(dr[u].dot(vs));
                const float pr = j0 + u < count ? exp2f(s - lse2[u]) : 0.f;
                qr[u].axpby(1.f, pr * (dp - delta[u]), dk);
                dr[u].axpby(1.f, pr, dv);
            }
        }
    }
    if (count == 0) return;
    x.load(p.dk + at * D, r.sub);
    x.axpby(p.scale, 1.f, dk);
    store_piece<D>(p.dk + at * D, r.sub, dk, 1.f);
    x.load(p.dv + at * D, r.sub);
    x.axpby(1.f, 1.f, dv);
    store_piece<D>(p.dv + at * D, r.sub, dv, 1.f);
}

// dK and dV of the sink keys: key s < sinks pairs with every query i >= s + window, up to L of
// them, too many for one row's lanes. A block takes one key and SINK_QUERIES consecutive
// queries per lane group (of each query head sharing the KV head), sums its groups' terms in
// shared memory, and adds them to fp32 sums [B, Hkv, sinks, D] (unscaled dK, dV), which the
// host adds to the tile pass's dk and dv.
constexpr int SINK_QUERIES = 16;

template <int D>
__global__ void __launch_bounds__(PAIR_THREADS) sink_dkdv_kernel(PairArgs p, float* dk_sum, float* dv_sum) {
    constexpr int E = RowPiece<D>::E;
    __shared__ float part[2][PAIR_ROWS][D];
    const int sub = threadIdx.x % PAIR_LANES, grp = threadIdx.x / PAIR_LANES;
    const int key = blockIdx.y, bkv = blockIdx.z;
    const int first = key + p.window + blockIdx.x * PAIR_ROWS * SINK_QUERIES;  // the block's first query
    if (first >= p.len) return;  // uniform over the block
    const int q0 = first + grp * SINK_QUERIES;
    const int64_t at = (int64_t)bkv * p.len + key;
    float ks[E], vs[E], dk[E], dv[E];
    RowPiece<D> x;
    x.load(p.k + at * D, sub);
    x.scaled(p.scale * LOG2E, ks);
    x.load(p.v + at * D, sub);
    x.scaled(1.f, vs);
    for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0.f;
    const int group = p.heads / p.kv_heads;
    for (int g = 0; g < group; ++g) {
        const int64_t qh = (int64_t)(bkv / p.kv_heads * p.heads + bkv % p.kv_heads * group + g) * p.len;
        for (int u0 = 0; u0 < SINK_QUERIES; u0 += PAIR_UNROLL) {
            RowPiece<D> qr[PAIR_UNROLL], dr[PAIR_UNROLL];
            float lse2[PAIR_UNROLL], delta[PAIR_UNROLL];
#pragma unroll
            for (int u = 0; u < PAIR_UNROLL; ++u) {
                const int64_t qi = qh + min(q0 + u0 + u, p.len - 1);  // past the end: weighed zero
                qr[u].load(p.q + qi * D, sub);
                dr[u].load(p.dout + qi * D, sub);
                lse2[u] = p.lse_in[qi] * LOG2E;
                delta[u] = p.delta[qi];
            }
#pragma unroll
            for (int u = 0; u < PAIR_UNROLL; ++u) {
                const float s = group_sum(qr[u].dot(ks)), dp = group_sum(dr[u].dot(vs));
                const float pr = q0 + u0 + u < p.len ? exp2f(s - lse2[u]) : 0.f;
                qr[u].axpby(1.f, pr * (dp - delta[u]), dk);
                dr[u].axpby(1.f, pr, dv);
            }
        }
    }
    // The lane's columns in the row: piece c holds columns (c * PAIR_LANES + sub) * 8 ...
#pragma unroll
    for (int c = 0; c < RowPiece<D>::N; ++c)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            part[0][grp][(c * PAIR_LANES + sub) * 8 + e] = dk[c * 8 + e];
            part[1][grp][(c * PAIR_LANES + sub) * 8 + e] = dv[c * 8 + e];
        }
    __syncthreads();
    const int64_t out = ((int64_t)bkv * p.sinks + key) * D;
    for (int i = threadIdx.x; i < 2 * D; i += PAIR_THREADS) {
        const int which = i / D, col = i % D;
        float sum = 0.f;
        for (int r = 0; r < PAIR_ROWS; ++r) sum += part[which][r][col];
        atomicAdd((which ? dv_sum : dk_sum) + out + col, sum);
    }
}

// bf16 rows [B, H, L, D] of one shape, contiguous, D / 8 a power of two up to 32: the 16-byte
// chunks a row of them holds.
int64_t row_chunks(const char* what, std::initializer_list<const at::Tensor*> xs) {
    const at::Tensor& x0 = **xs.begin();
    for (const at::Tensor* x : xs)
        TORCH_CHECK(x->sizes() == x0.sizes() && x->dim() == 4 && x->is_contiguous() &&
                        x->scalar_type() == at::kBFloat16 && x->device() == x0.device(),
                    what, ": inputs must be contiguous bf16 tensors [B, H, L, D] of one shape on one device");
    const int64_t d = x0.size(3), chunks = d / 8;
    TORCH_CHECK(d >= 8 && d % 8 == 0 && chunks <= 32 && (chunks & (chunks - 1)) == 0, what,
                ": head_dim must be 8 times a power of two up to 256, not ", d);
    check_aligned16(what, xs);
    return chunks;
}

}  // namespace

at::Tensor cuda_row_dot(const at::Tensor& a, const at::Tensor& b, const at::Tensor* minus, const at::Tensor* perm) {
    const at::cuda::CUDAGuard guard(a.device());
    const int64_t chunks = minus ? row_chunks("row dot", {&a, &b, minus}) : row_chunks("row dot", {&a, &b});
    auto dot = at::empty({a.size(0), a.size(1), a.size(2)}, a.options().dtype(at::kFloat));
    TORCH_CHECK(!perm || (perm->sizes() == dot.sizes() && perm->scalar_type() == at::kInt && perm->is_contiguous() &&
                          perm->device() == a.device()),
                "row dot: perm must be contiguous int32 [B, H, L] on the inputs' device");
    const int64_t rows = dot.numel();
    if (rows > 0) {
        constexpr int threads = 256;
        row_dot_kernel<<<(rows * chunks + threads - 1) / threads, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
            reinterpret_cast<const uint4*>(a.data_ptr()), reinterpret_cast<const uint4*>(b.data_ptr()),
            minus ? reinterpret_cast<const uint4*>(minus->data_ptr()) : nullptr, perm ? perm->data_ptr<int>() : nullptr,
            (int)a.size(2), (int)chunks, rows, dot.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return dot;
}

at::Tensor cuda_st_mix(const at::Tensor& c, const at::Tensor& o, const at::Tensor& w) {
    const at::cuda::CUDAGuard guard(c.device());
    const int64_t chunks = row_chunks("straight-through mix", {&c, &o});
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() * chunks * 8 == c.numel(),
                "straight-through mix: the weight must be contiguous fp32 [B, H, L]");
    auto y = at::empty_like(c);
    const int64_t n = c.numel() / 8;
    if (n > 0) {
        constexpr int threads = 256;
        st_mix_kernel<<<(n + threads - 1) / threads, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
            reinterpret_cast<const uint4*>(c.data_ptr()), reinterpret_cast<const uint4*>(o.data_ptr()),
            w.data_ptr<float>(), (int)chunks, n, reinterpret_cast<uint4*>(y.data_ptr()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return y;
}

at::Tensor cuda_far_table(const at::Tensor& offsets, int64_t len, int64_t window) {
    const at::cuda::CUDAGuard guard(offsets.device());
    auto table = at::empty({far_words((int)len) + 2 * len}, offsets.options().dtype(at::kInt));
    if (len > 0) {
        far_table_kernel<<<far_words((int)len), 32, 0, at::cuda::getCurrentCUDAStream()>>>(
            offsets.data_ptr<int>(), (int)offsets.numel(), (int)len, (int)std::min(window, len), table.data_ptr<int>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return table;
}

ListShape list_shape(const at::Tensor& q, const at::Tensor& k, const QueryList& list, int64_t window) {
    ListShape a{};
    a.qpos = list.qpos ? list.qpos->data_ptr<int>() : nullptr;
    a.nq = list.nq ? list.nq->data_ptr<int>() : nullptr;
    a.nfull = list.nfull ? list.nfull->data_ptr<int>() : nullptr;
    a.far = list.far ? list.far->data_ptr<int>() : nullptr;
    a.at_positions = list.at_positions;
    a.heads = (int)q.size(1);
    a.kv_heads = (int)k.size(1);
    a.lq = (int)q.size(2);
    a.len = (int)k.size(2);
    a.window = (int)std::min<int64_t>(window, INT32_MAX);
    a.scale = 1.0f / std::sqrt((float)q.size(3));
    return a;
}

// With a far table the sm90 kernels mask by its bits alone, which hold the window's distances:
// every row must see its window, none its whole prefix.
static void check_far(const QueryList& list) {
    TORCH_CHECK(!list.far || !list.nfull, "a list with PPA's far distances cannot hold full-prefix rows");
}

void cuda_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
                  at::Tensor& out, at::Tensor& lse) {
    const at::cuda::CUDAGuard guard(q.device());
    check_far(list);
    if (q.numel() == 0) return;  // a grid of zero blocks would not launch
    if (use_sm90()) {
        sm90_forward(q, k, v, list, window, out, lse);
        return;
    }
    Args a = make_args(q, k, v, list, window);
    a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    a.lse = lse.data_ptr<float>();
    const int d = (int)q.size(3);
    dim3 grid((a.lq + BQ - 1) / BQ, q.size(0) * a.heads);
    const size_t smem = (size_t)(4 * BK) * (d + PAD) * sizeof(__nv_bfloat16);
    by_far(list.far, [&](auto far) {
        if (d == 64) launch(forward_kernel<64, far()>, grid, smem, a);
        else launch(forward_kernel<128, far()>, grid, smem, a);
    });
}

void cuda_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list,
                   int64_t window, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
    const at::cuda::CUDAGuard guard(q.device());
    check_far(list);
    if (q.numel() == 0) {  // no query sees a key
        dk.zero_(), dv.zero_();
        return;
    }
    Args a = make_args(q, k, v, list, window);
    bind_backward(a, lse, delta, dout, dq, dk, dv);
    const int d = (int)q.size(3);
    const size_t smem = (size_t)(2 * BQ + 2 * BK) * (d + PAD) * sizeof(__nv_bfloat16);
    dim3 qgrid((a.lq + BQ - 1) / BQ, q.size(0) * a.heads);
    dim3 kgrid((a.len + BK - 1) / BK, k.size(0) * a.kv_heads);
    by_far(list.far, [&](auto far) {
        if (use_sm90()) sm90_dq(q, k, v, list, window, lse, delta, dout, dq);
        else if (d == 64) launch(dq_kernel<64, far()>, qgrid, smem, a);
        else launch(dq_kernel<128, far()>, qgrid, smem, a);
        // dK, dV on wgmma for every list on Hopper: one pass for both outputs since the
        // producer warpgroup gives its registers to the consumers (narrow windows at head_dim
        // 128 ran slower there than on mma.sync while each output took a launch: PERFORMANCE.md,
        // v4, v7 and the fused dK/dV entry).
        if (use_sm90())
            sm90_dkdv(q, k, v, list, window, lse, delta, dout, dk, dv);
        else if (d == 64) launch(dkdv_kernel<64, far()>, kgrid, smem, a);
        else launch(dkdv_kernel<128, far()>, kgrid, smem, a);
    });
}

namespace {

// The pair kernels' arguments, with far's distances (int32 on q's device, ascending, each
// below L: the far distances the tile kernels leave out).
PairArgs pair_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& far) {
    TORCH_CHECK(far.scalar_type() == at::kInt && far.dim() == 1 && far.is_contiguous() && far.device() == q.device(),
                "far pairs: the distances must be a contiguous 1-d int32 tensor on q's device");
    PairArgs a{};
    static_cast<Args&>(a) = make_args(q, k, v, QueryList{}, 0);
    a.offsets = far.data_ptr<int>();
    a.n = (int)far.numel();
    return a;
}

// The pair kernels' arguments for the first `sinks` keys beyond each query's window.
PairArgs sink_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sinks, int64_t window) {
    PairArgs a{};
    static_cast<Args&>(a) = make_args(q, k, v, QueryList{}, window);
    a.sinks = (int)std::min<int64_t>(sinks, a.len);
    return a;
}

template <typename Kernel>
void launch_pairs(Kernel kernel, int rows, int64_t heads, const PairArgs& a) {
    const dim3 grid((rows + PAIR_ROWS - 1) / PAIR_ROWS, heads);
    kernel<<<grid, PAIR_THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void cuda_far_pairs_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& far,
                            at::Tensor& out, at::Tensor& lse) {
    const at::cuda::CUDAGuard guard(q.device());
    if (q.numel() == 0 || far.numel() == 0) return;
    PairArgs a = pair_args(q, k, v, far);
    a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    a.lse = lse.data_ptr<float>();
    if (q.size(3) == 64) launch_pairs(far_forward_kernel<64>, a.len, q.size(0) * a.heads, a);
    else launch_pairs(far_forward_kernel<128>, a.len, q.size(0) * a.heads, a);
}

void cuda_far_pairs_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& far,
                             const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq,
                             at::Tensor& dk, at::Tensor& dv) {
    const at::cuda::CUDAGuard guard(q.device());
    if (q.numel() == 0 || far.numel() == 0) return;
    PairArgs a = pair_args(q, k, v, far);
    bind_backward(a, lse, delta, dout, dq, dk, dv);
    if (q.size(3) == 64) {
        launch_pairs(far_dq_kernel<64>, a.len, q.size(0) * a.heads, a);
        launch_pairs(far_dkdv_kernel<64>, a.len, k.size(0) * a.kv_heads, a);
    } else {
        launch_pairs(far_dq_kernel<128>, a.len, q.size(0) * a.heads, a);
        launch_pairs(far_dkdv_kernel<128>, a.len, k.size(0) * a.kv_heads, a);
    }
}

void cuda_sink_pairs_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sinks,
                             int64_t window, at::Tensor& out, at::Tensor& lse) {
    const at::cuda::CUDAGuard guard(q.device());
    if (q.numel() == 0 || sinks <= 0 || window >= k.size(2)) return;
    PairArgs a = sink_args(q, k, v, sinks, window);
    a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    a.lse = lse.data_ptr<float>();
    if (q.size(3) == 64) launch_pairs(far_forward_kernel<64>, a.len, q.size(0) * a.heads, a);
    else launch_pairs(far_forward_kernel<128>, a.len, q.size(0) * a.heads, a);
}

void cuda_sink_pairs_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sinks,
                              int64_t window, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout,
                              at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
    const at::cuda::CUDAGuard guard(q.device());
    if (q.numel() == 0 || sinks <= 0 || window >= k.size(2)) return;
    PairArgs a = sink_args(q, k, v, sinks, window);
    bind_backward(a, lse, delta, dout, dq, dk, dv);
    const int64_t s = a.sinks;
    auto sums = at::zeros({2, k.size(0), k.size(1), s, k.size(3)}, q.options().dtype(at::kFloat));
    const dim3 grid((unsigned)((a.len - a.window + PAIR_ROWS * SINK_QUERIES - 1) / (PAIR_ROWS * SINK_QUERIES)),
                    (unsigned)s, (unsigned)(k.size(0) * a.kv_heads));
    auto* dk_sum = sums.data_ptr<float>();
    auto* dv_sum = dk_sum + sums[0].numel();
    if (q.size(3) == 64) {
        launch_pairs(far_dq_kernel<64>, a.len, q.size(0) * a.heads, a);
        sink_dkdv_kernel<64><<<grid, PAIR_THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(a, dk_sum, dv_sum);
    } else {
        launch_pairs(far_dq_kernel<128>, a.len, q.size(0) * a.heads, a);
        sink_dkdv_kernel<128><<<grid, PAIR_THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(a, dk_sum, dv_sum);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // dK = scale * sum dS q, dV = sum P dO, added to the tile pass's in fp32, rounded once.
    auto add = [&](at::Tensor& grad, const at::Tensor& sum, double mul) {
        auto rows = grad.narrow(2, 0, s);
        rows.copy_(rows.to(at::kFloat) + sum * mul);
    };
    add(dk, sums[0], a.scale);
    add(dv, sums[1], 1.0);
}

void cuda_aha_gates(const at::Tensor& scores, double tau, double sample, uint32_t salt, int64_t start, int64_t window,
                    at::Tensor& hard, at::Tensor& chosen, at::Tensor& other, at::Tensor& coef, at::Tensor& pairs) {
    const at::cuda::CUDAGuard guard(scores.device());
    const int64_t n = scores.numel();
    if (n == 0) return;
    const AhaGateArgs a{(float)tau, sample, salt, start, (int)window};
    aha_gates_kernel<<<(n + GATE_THREADS - 1) / GATE_THREADS, GATE_THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
        scores.data_ptr<float>(), n, (int)scores.size(1), (int)scores.size(2), a, hard.data_ptr<float>(),
        chosen.data_ptr<uint8_t>(), other.data_ptr<uint8_t>(), coef.data_ptr<float>(), pairs.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cuda_route_list(const at::Tensor& path, at::Tensor& perm, at::Tensor& nq, at::Tensor& nfull) {
    const at::cuda::CUDAGuard guard(path.device());
    if (nq.numel() == 0) return;
    const int len = (int)path.size(2);
    route_kernel<<<path.size(0) * path.size(1), ROUTE_THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
        path.data_ptr<uint8_t>(), len, perm.data_ptr<int>(), nq.data_ptr<int>(), nfull.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attnsweep
