// Launchers of the CUDA attention kernels (attention.cu), called by the autograd layer in
// ops.cpp. Tensors: q [B, H, Lq, D], k and v [B, Hkv, L, D], all bf16 and contiguous;
// lse, delta [B, H, Lq] fp32, in list order.
#pragma once
#include <ATen/ATen.h>

namespace attnsweep {

// The query list of a call. qpos [B, H, Lq] int32 positions and nq [B, H] int32 counts, or
// both null for the dense case (query r at position r, all Lq active). nfull [B, H] int32, or
// null: the first nfull rows see their whole prefix, the other active rows their window
// (routed attention: both paths in one list; each of the two groups ascends). at_positions:
// qpos holds a permutation of all Lq = L positions, and the outputs (O, dQ) are written at
// the rows' positions instead of in list order (lse stays in list order).
// far: PPA's distances beyond the window as a table (cuda_far_table), or null; with it every
// query also sees the keys at those distances back (dense lists only). far_count: how many
// far distances the table holds (the forward's key tile follows their spacing).
struct QueryList {
    const at::Tensor *qpos = nullptr, *nq = nullptr, *nfull = nullptr;
    bool at_positions = false;
    const at::Tensor* far = nullptr;
    int64_t far_count = 0;
};

// What every kernel knows of a call: the query list and the shapes.
struct ListShape {
    const int *qpos, *nq, *nfull;
    const int* far;  // PPA's far distances (walk.cuh, far_above), or null
    bool at_positions;
    int heads, kv_heads, lq, len, window;
    float scale;  // softmax scale, 1/sqrt(D)
};

ListShape list_shape(const at::Tensor& q, const at::Tensor& k, const QueryList& list, int64_t window);

void cuda_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
                  at::Tensor& out, at::Tensor& lse);

// The forward on Hopper's wgmma (attention_sm90.cu); same contract as cuda_forward, which
// calls it on compute capability 9.0 in libraries built for sm_90a.
void sm90_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
                  at::Tensor& out, at::Tensor& lse);

// dQ, and dK with dV, of the backward on Hopper's wgmma (attention_sm90.cu); cuda_backward
// calls them where cuda_forward calls sm90_forward.
void sm90_dq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
             const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq);
void sm90_dkdv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list, int64_t window,
               const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dk, at::Tensor& dv);

void cuda_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const QueryList& list,
                   int64_t window, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

// [B, H, Lq] fp32 rowsum(a * (b - minus)) of each list row (minus may be null): the
// backward's delta = rowsum(dO * O), and the straight-through mix's weight gradient. a, b,
// minus [B, H, Lq, D] bf16, contiguous. With perm ([B, H, Lq] int32, a list at positions,
// which holds all Lq = L positions) row i of (b, h) is read at position perm[b, h, i].
at::Tensor cuda_row_dot(const at::Tensor& a, const at::Tensor& b, const at::Tensor* minus, const at::Tensor* perm);

// PPA's far distances the tile kernels leave out, pair by pair (far: int32, ascending, each
// below L, on q's device; dense lists): the forward merges their pairs into the tile pass's out
// and lse, the backward adds their terms to the tile pass's dq, dk and dv (both in place).
void cuda_far_pairs_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& far,
                            at::Tensor& out, at::Tensor& lse);
void cuda_far_pairs_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& far,
                             const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout, at::Tensor& dq,
                             at::Tensor& dk, at::Tensor& dv);

// Attention sinks: the first `sinks` keys (positions), which every query sees, paired with the
// queries that do not see them through their window (dense lists; the tile pass runs the
// window): the forward merges their pairs into the tile pass's out and lse, the backward adds
// their terms to the tile pass's dq, dk and dv (both in place).
void cuda_sink_pairs_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sinks,
                             int64_t window, at::Tensor& out, at::Tensor& lse);
void cuda_sink_pairs_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sinks,
                              int64_t window, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dout,
                              at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

// AHA's straight-through mix y = c + w (c - o): c, o [B, H, L, D] bf16, contiguous, w
// [B, H, L] fp32 contiguous.
at::Tensor cuda_st_mix(const at::Tensor& c, const at::Tensor& o, const at::Tensor& w);

// PPA's far distances as the table QueryList::far takes (walk.cuh has its layout), from
// offsets: int32, ascending (entries outside [0, len) see nothing), and the window.
at::Tensor cuda_far_table(const at::Tensor& offsets, int64_t len, int64_t window);

// AHA's gates of one layer (walk.cuh, aha_route; salt: aha_salt of the seed and the layer) from
// router scores [B, L, H] fp32, contiguous: hard [B, L, H] fp32, chosen and other [B, H, L]
// uint8, coef [B, H, L] fp32, and the chosen paths' key-query pairs added to pairs (fp64, one
// element).
void cuda_aha_gates(const at::Tensor& scores, double tau, double sample, uint32_t salt, int64_t start, int64_t window,
                    at::Tensor& hard, at::Tensor& chosen, at::Tensor& other, at::Tensor& coef, at::Tensor& pairs);

// The routed list of each (b, h) from path [B, H, L] (uint8: 2 the query sees its whole
// prefix, 1 its window, 0 or any other value nothing; the C API rejects other values where it
// can read them without a device synchronisation): perm [B, H, L] int32, the positions in list order
// (full-prefix rows, then window rows, then the rest, each ascending), nq and nfull [B, H]
// int32 the attending and the full-prefix rows.
void cuda_route_list(const at::Tensor& path, at::Tensor& perm, at::Tensor& nq, at::Tensor& nfull);

}  // namespace attnsweep
