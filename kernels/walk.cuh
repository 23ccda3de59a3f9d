// Which keys a query sees and which tiles the attention kernels' walks visit: AHA's gates
// (which path a (token, head) takes), the window, routed lists' row groups, and PPA's far
// distances. Host-compilable (walk_test.cpp checks the walks on the CPU against the masks they
// stand for; ops.cpp runs the gates on CPU tensors); common.cuh includes it for the kernels.
#pragma once
#include <cstdint>

#ifndef __CUDACC__
#include <algorithm>
#define __host__
#define __device__
#define __forceinline__ inline
inline int __ldg(const int* p) { return *p; }
inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t shift) {
    return (uint32_t)((((uint64_t)hi << 32) | lo) >> (shift & 31));
}
using std::max;
using std::min;
#endif

namespace attnsweep {
namespace {

// Whether query position pos sees key (pos < 0 marks a row without a query).
__device__ __forceinline__ bool visible(int key, int pos, int window, int len) {
    return pos >= 0 && key <= pos && pos - key < window && key < len;
}

// AHA's gates of one layer (attention.rs, SelfAttention::forward, has the reference in ATen):
// the gate of (batch row b, position pos, head h) is open (the whole prefix) where its router
// score s > tau, else the window. With the router's gradient, a window query is probed (also
// runs the whole prefix, for the straight-through gradient dy . (full - local)) where a uniform
// draw u(seed, layer, b, pos, h) < sample; its gradient is then scaled by 1 / sample (sample
// 1: every window query, the exact gradient).
struct AhaGateArgs {
    float tau;
    double sample;
    uint32_t salt;  // of (seed, layer): aha_salt
    int64_t start;  // position of the chunk's first query
    int window;
};

__host__ __device__ __forceinline__ uint32_t aha_salt(uint64_t seed, uint64_t layer) {
    return (uint32_t)(seed ^ (seed >> 32) ^ layer * 0x9E3779B9ull);
}

// The draw in [0, 1): attention.rs's hash_uniform, which computes it in int64 ATen ops masked
// to 32 bits, is the same arithmetic modulo 2^32.
__host__ __device__ __forceinline__ double aha_uniform(uint32_t salt, int64_t b, int64_t pos, int64_t h) {
    uint32_t x = (uint32_t)b * 0x2545F491u + (uint32_t)pos * 0x1B873593u + (uint32_t)h * 0x5BD1E995u + salt;
    const uint32_t muls[3] = {0x7FEB352Du, 0x046B2B8Bu, 0x2C1B3C6Du};
    for (int i = 0; i < 3; ++i) x = (x ^ x >> 16) * muls[i];
    return (double)(x ^ x >> 15) / 4294967296.0;
}

// What one gate decides: the path its query runs with gradient (`chosen`, QueryPath values: 2
// whole prefix, 1 window), the path the straight-through gradient also needs (`other`: the
// window for an open gate, the whole prefix for a probed one, 0 nothing), the factor
// d score = coef * d w of the mix weight w (attention.rs, per_head: (g - on) (2 on - 1)), and
// the key-query pairs the chosen path attends.
struct AhaRoute {
    uint8_t chosen, other;
    float coef;
    bool on;
    int64_t pairs;
};
__host__ __device__ __forceinline__ AhaRoute aha_route(const AhaGateArgs& a, float s, int64_t b, int64_t l, int64_t h) {
    const int64_t pos = a.start + l;
    const bool on = s > a.tau, probe = !on && aha_uniform(a.salt, b, pos, h) < a.sample;
    AhaRoute r;
    r.on = on;
    r.chosen = on ? 2 : 1;
    r.other = on ? 1 : probe ? 2 : 0;
    r.coef = on ? 1.f : probe ? -(float)(1.0 / a.sample) : 0.f;
    r.pairs = on || pos < a.window ? pos + 1 : a.window;
    return r;
}

// PPA's far distances (ListShape::far, null for the other patterns): the distances d >= window
// a query also sees, as one int32 table (cuda_far_table): the bit of each distance a query sees
// (the window's and the far ones), then for each distance the nearest far one at or above it
// (INT32_MAX if none), then the nearest far one at or below it (-1 if none). The bits are the
// masks: with the window in them the sm90 forward and dK/dV kernels mask a score with one bit
// test, where the window's comparisons took three more (PERFORMANCE.md, PPA's mask as one bit
// test); the other kernels still compare too, which the bits make redundant, not wrong. The two
// neighbours let a tile walk jump over the far tiles no pair of which is seen, in one load (the
// far distances of sparse powers thin out with distance, so most far tiles hold none).
__host__ __device__ __forceinline__ int far_words(int len) { return (len + 31) / 32; }

// What the far-distance helpers below read of a call, with far a null the compiler can see
// where FAR is false: kernels instantiated without PPA carry none of its code or registers.
template <bool FAR>
struct FarView {
    const int* far;
    int len, window;
    template <typename Shape>
    __device__ explicit FarView(const Shape& p) : far(FAR ? p.far : nullptr), len(p.len), window(p.window) {}
};
template <typename Shape>
__device__ __forceinline__ int far_above(const Shape& p, int d) {
    return __ldg(p.far + far_words(p.len) + d);
}
template <typename Shape>
__device__ __forceinline__ int far_below(const Shape& p, int d) {
    return __ldg(p.far + far_words(p.len) + (int64_t)p.len + d);
}

// PPA's bits of the 64 distances from d0 (bit i: distance d0 + i; none outside [0, len), none
// without p.far). Kernels take a thread's 64 at once, as three word loads: each row's
// distances to a tile's columns are consecutive, and a load per pair costs registers the
// backward kernels do not have.
template <typename Shape>
__device__ __forceinline__ uint64_t far_bits64(const Shape& p, int d0) {
    if (!p.far) return 0;
    const int w = d0 >> 5, words = far_words(p.len);  // w: floor(d0 / 32), d0 may be negative
    uint32_t r[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) r[k] = w + k >= 0 && w + k < words ? (uint32_t)__ldg(p.far + w + k) : 0u;
    return (uint64_t)__funnelshift_r(r[0], r[1], d0 & 31) | (uint64_t)__funnelshift_r(r[1], r[2], d0 & 31) << 32;
}

// Whether a query sees any key at a distance in [dlo, dhi] (clipped to [0, len)): one in the
// window, or a far one (PPA).
template <typename Shape>
__device__ __forceinline__ bool sees_any(const Shape& p, int dlo, int dhi, int window) {
    dlo = max(dlo, 0);
    dhi = min(dhi, p.len - 1);
    if (dlo > dhi) return false;
    if (dlo < window) return true;
    return p.far && far_above(p, dlo) <= dhi;
}

// The first of a dense list's query tiles r0, r0 + rows, ... (below end; positions are rows)
// that sees a key of [k0, k0 + keys): r0 itself except for PPA, whose far tiles unseen are
// skipped (end if none is seen). Distances grow with r0, so past the window only a far
// distance can be seen: the tile holding the nearest one at or above this tile's lowest.
template <typename Shape>
__device__ __forceinline__ int seen_rows_from(const Shape& p, int r0, int end, int k0, int keys, int rows) {
    if (!p.far || r0 >= end) return r0;
    const int dlo = r0 - (k0 + keys - 1), dhi = r0 + rows - 1 - k0;
    if (sees_any(p, dlo, dhi, p.window)) return r0;
    const int o = far_above(p, max(dlo, 0));
    if (o >= p.len) return end;
    return min(end, r0 + (o - dhi + rows - 1) / rows * rows);  // o > dhi
}

// The window of list row r: rows below `full` (a routed list's full-prefix rows; pass a
// negative value for lists without them) see their whole prefix.
__device__ __forceinline__ int row_window(int r, int full, int window) { return r < full ? INT32_MAX : window; }

// What rows [first, last] of a block's list rows (indices into spos, all holding queries) can
// see: the lowest and highest visible key, the lowest position, and the highest position
// among window rows (-1 if none). Rows below `full` (same indexing) see their whole prefix;
// each group ascends.
struct RowSpan {
    int key_lo, key_hi, pmin, pmax_window;
};
__device__ __forceinline__ RowSpan row_span(const int* spos, int first, int last, int full, int window, int len) {
    const bool any_full = first < full, any_window = last >= full;
    RowSpan s;
    s.key_lo = any_full ? 0 : max(0, spos[first] - window + 1);
    s.key_hi = min(max(any_full ? spos[min(last, full - 1)] : -1, any_window ? spos[last] : -1), len - 1);
    s.pmin = min(any_full ? spos[first] : INT32_MAX, any_window ? spos[max(first, full)] : INT32_MAX);
    s.pmax_window = any_window ? spos[last] : -1;
    return s;
}

// A query head's rows in one group of its list and their window: group 0 the full-prefix
// rows [0, nfull), group 1 the window rows [nfull, nq). The dK/dV kernels visit them apart, so
// positions ascend within each tile.
struct RowGroup {
    int lo, hi, window;
};
__device__ __forceinline__ RowGroup row_group(int group, int nq, int nfull, int window) {
    return group ? RowGroup{nfull, nq, window} : RowGroup{0, nfull, INT32_MAX};
}

// The row of q, dO, O and dQ that list row r of the list at qbase reads or writes: its
// position where the list works at positions (p: a ListShape).
template <typename Shape>
__device__ __forceinline__ int64_t out_row(const Shape& p, int64_t qbase, int r) {
    return qbase + (p.at_positions ? p.qpos[qbase + r] : r);
}

// The first key tile from t on (tiles of bk keys; past span.key_hi / bk if none) that a dense
// list's rows of span see: t itself except for PPA, whose far tiles unseen are skipped.
// Distances fall as t grows: from tile t_win on every tile reaches into the rows' windows;
// before it, only the tile holding the nearest far distance at or below this tile's highest.
template <typename Shape>
__device__ __forceinline__ int seen_tile_from(const Shape& p, int t, const RowSpan& s, int bk) {
    if (!p.far || t > s.key_hi / bk) return t;
    const int64_t num = (int64_t)s.pmin - bk + 1 - p.window;  // tile t reaches the window iff t * bk > num
    const int t_win = num < 0 ? 0 : (int)(num / bk) + 1;
    if (t >= t_win) return t;
    const int o = far_below(p, min(s.key_hi - t * bk, p.len - 1));
    if (o < 0) return t_win;
    const int lowest = s.pmin - t * bk - bk + 1;  // tile t's lowest distance
    return o >= lowest ? t : min(t_win, (s.pmin - bk + 1 - o + bk - 1) / bk);  // o < lowest
}

// The key tile after t that the rows of span see (t + 1 but for PPA).
template <typename Shape>
__device__ __forceinline__ int next_tile(const Shape& p, int t, const RowSpan& s, int bk) {
    return seen_tile_from(p, t + 1, s, bk);
}

// The first key tile the rows of span see: the window's first, or for PPA the first from key 0.
template <typename Shape>
__device__ __forceinline__ int first_tile(const Shape& p, const RowSpan& s, int bk) {
    return p.far ? seen_tile_from(p, 0, s, bk) : s.key_lo / bk;
}

// Whether keys [k0, k0 + n) lie inside the window of every row of the span (no mask needed).
__device__ __forceinline__ bool inside(const RowSpan& s, int k0, int n, int window, int len) {
    return k0 + n - 1 <= s.pmin && s.pmax_window - k0 < window && k0 + n <= len;
}

}  // namespace
}  // namespace attnsweep
