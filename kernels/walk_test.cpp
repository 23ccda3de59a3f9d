// Host check of the PPA tile walks and masks (walk.cuh) that every attention kernel runs: each
// kernel's thread layout is emulated (which tiles its walk visits, which pairs its mask keeps)
// and the pairs kept must be exactly the PPA mask, for fixed and random (L, window, p); the
// far-distance helpers are checked against brute force. The table is built by the host twin of
// far_table_kernel. Prints the failures and exits non-zero on any.
// With --tiles it prints instead the share of the causal tiles the Hopper forward's walks visit
// for PPA, w = 64 (128-row blocks and their 64-row warpgroups, 64-key tiles), L 4096 to
// 32768, and the exponent fitted to the visited tiles against L: the performance log's
// prediction for the PPA tile path.
// Build: g++ -std=c++17 -O2 -I kernels kernels/walk_test.cpp (the test suite does).
#include "walk.cuh"

#include <climits>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

using namespace attnsweep;

struct Shape { const int* far; int len, window; };

static bool is_off(long d, double p) {  // S_p
    if (d < 1) return false;
    auto f = [&](long j) { return j == 0 ? 0.0 : std::floor(std::pow((double)j, p) + 1e-9); };
    return f(d) - f(d - 1) == 1.0;
}
int fails = 0;
// Host twin of far_table_kernel (same per-distance rule).
std::vector<int> build_table(const std::vector<int>& offsets, int len, int window) {
    int W = (len + 31) / 32, n = offsets.size();
    std::vector<int> t(W + 2 * len, 0);
    for (int d = 0; d < W * 32; ++d) {
        int lo = std::lower_bound(offsets.begin(), offsets.end(), d) - offsets.begin();
        bool far = d < len && lo < n && offsets[lo] == d;
        if (far || (d < len && d < window)) t[d / 32] |= 1u << (d % 32);
        if (d < len) { t[W + d] = lo < n && offsets[lo] < len ? offsets[lo] : INT32_MAX; t[W + len + d] = far ? d : lo > 0 ? offsets[lo - 1] : -1; }
    }
    return t;
}
// The walks for far distances offs (ascending, in [w, L)); pw names the case (a power, or -1
// for a random set).
void check(int L, int w, const std::vector<int>& offs, double pw) {
    std::vector<char> ref(L, 0);  // visible distance
    for (int d = 0; d < L; ++d) ref[d] = d < w;
    for (int d : offs) ref[d] = 1;
    std::vector<int> table = build_table(offs, L, w);
    Shape p{table.data(), L, w};
    auto vis = [&](int q, int k) { return k <= q && q < L && k >= 0 && ref[q - k]; };
    // covered[q][k]: pair visited in a tile and passing the mask.
    std::vector<char> cov;
    auto run = [&](const char* name, auto body) {
        cov.assign((size_t)L * L, 0);
        body();
        long missing = 0, extra = 0;
        for (int q = 0; q < L; ++q) for (int k = 0; k < L; ++k) {
            bool v = vis(q, k), c = cov[(size_t)q * L + k];
            missing += v && !c;
            extra += !v && c;
        }
        if (missing || extra) { ++fails; printf("FAIL %s L=%d w=%d p=%g missing=%ld extra=%ld\n", name, L, w, pw, missing, extra); }
    };
    // Forward/dQ row-tile kernels: block of BQ rows, warp rows r_lo(+8), thread columns.
    auto rowkernel = [&](int BQ, int BK, int WROWS, bool sm90) {
        for (int row0 = 0; row0 < L; row0 += BQ) {
            int spos[256]; for (int i = 0; i < BQ; ++i) spos[i] = row0 + i < L ? row0 + i : -1;
            int last = min(row0 + BQ, L) - 1 - row0;
            RowSpan span = row_span(spos, 0, last, -1 - row0, w, L);
            int t_last = span.key_hi / BK;
            for (int t = first_tile(p, span, BK); t <= t_last; t = next_tile(p, t, span, BK)) {
                int k0 = t * BK;
                for (int wg = 0; wg < BQ / WROWS; ++wg) {
                    int w_first = wg * WROWS, w_last = min(wg * WROWS + WROWS - 1, last);
                    bool seen = true;
                    RowSpan ws = span;
                    if (sm90) {
                        ws = w_first <= last ? row_span(spos, w_first, w_last, -1 - row0, w, L) : RowSpan{INT32_MAX, -1, 0, -1};
                        seen = sees_any(p, ws.pmin - (k0 + BK - 1), ws.key_hi - k0, w);
                    }
                    if (!seen) continue;
                    bool ins = sm90 && inside(ws, k0, BK, w, L);
                    for (int warp = 0; warp < WROWS / 16; ++warp) for (int lane = 0; lane < 32; ++lane) {
                        int r_lo = wg * WROWS + warp * 16 + lane / 4;
                        int pos_row[2] = {spos[r_lo], spos[r_lo + 8]};
                        uint64_t far[2][2];
                        for (int hr = 0; hr < 2; ++hr) for (int h = 0; h < BK / 64; ++h)
                            far[hr][h] = far_bits64(p, pos_row[hr] - k0 - (lane % 4) * 2 - (BK - 1) + 64 * h);
                        for (int e = 0; e < BK / 2; ++e) {
                            int key = k0 + (e / 4) * 8 + (lane % 4) * 2 + (e & 1), hr = (e >> 1) & 1;
                            int idx = BK - 1 - (e / 4) * 8 - (e & 1);
                            bool ok;
                            if (!sm90) {
                                bool interior = k0 + BK - 1 <= pos_row[0] && k0 + BK - 1 <= pos_row[1] && pos_row[0] - k0 < w && pos_row[1] - k0 < w && k0 + BK <= L;
                                ok = interior || visible(key, pos_row[hr], w, L) || ((far[hr][idx / 64] >> (idx % 64)) & 1);
                            } else ok = ins || ((far[hr][idx / 64] >> (idx % 64)) & 1);
                            if (ok && pos_row[hr] >= 0 && key < L) cov[(size_t)pos_row[hr] * L + key] = 1;
                        }
                    }
                }
            }
        }
    };
    run("sm90 fwd BK64", [&] { rowkernel(128, 64, 64, true); });
    run("sm90 fwd BK128", [&] { rowkernel(128, 128, 64, true); });
    run("portable fwd", [&] { rowkernel(64, 64, 64, false); });
    // sm90 kv_kernel: blocks of 128 keys, warpgroups of 64 keys, query tiles of 64.
    run("sm90 kv", [&] {
        for (int kb0 = 0; kb0 < L; kb0 += 128) {
            int lo = kb0, hi = L;  // ranges for dense far lists
            for (int r0 = seen_rows_from(p, lo, hi, kb0, 128, 64); r0 < hi; r0 = seen_rows_from(p, r0 + 64, hi, kb0, 128, 64)) {
                int n = min(64, hi - r0), pmin = r0, pmax = r0 + n - 1;
                for (int wg = 0; wg < 2; ++wg) {
                    int kw0 = kb0 + wg * 64;
                    if (!sees_any(p, pmin - (kw0 + 63), pmax - kw0, w)) continue;
                    for (int warp = 0; warp < 4; ++warp) for (int lane = 0; lane < 32; ++lane) {
                        int key_row[2] = {kw0 + warp * 16 + lane / 4, kw0 + warp * 16 + lane / 4 + 8};
                        bool interior = n == 64 && pmin >= kw0 + 63 && pmax - kw0 < w && kw0 + 63 < L;
                        uint64_t far[2] = {far_bits64(p, r0 + (lane % 4) * 2 - key_row[0]), far_bits64(p, r0 + (lane % 4) * 2 - key_row[1])};
                        for (int e = 0; e < 32; ++e) {
                            int c = (e / 4) * 8 + (lane % 4) * 2 + (e & 1), hr = (e >> 1) & 1;
                            int key = key_row[hr], q = r0 + c;
                            bool ok = interior ? c < n : (c < n) & ((far[hr] >> ((e / 4) * 8 + (e & 1))) & 1);
                            if (ok && key < L && q < L) cov[(size_t)q * L + key] = 1;
                        }
                    }
                }
            }
        }
    });
    // portable dkdv: key tiles of 64, query tiles of 64 (4 warps x 16 keys).
    run("portable kv", [&] {
        for (int k0 = 0; k0 < L; k0 += 64) {
            int r_begin = (k0 / 64) * 64, r_end = L;
            for (int row0 = seen_rows_from(p, r_begin, r_end, k0, 64, 64); row0 < r_end; row0 = seen_rows_from(p, row0 + 64, r_end, k0, 64, 64)) {
                int spos[64]; for (int i = 0; i < 64; ++i) spos[i] = row0 + i < L ? row0 + i : -1;
                for (int warp = 0; warp < 4; ++warp) for (int lane = 0; lane < 32; ++lane) {
                    int key_row[2] = {k0 + warp * 16 + lane / 4, k0 + warp * 16 + lane / 4 + 8};
                    uint64_t far[2] = {far_bits64(p, row0 + (lane % 4) * 2 - key_row[0]), far_bits64(p, row0 + (lane % 4) * 2 - key_row[1])};
                    for (int nb = 0; nb < 8; ++nb) for (int e = 0; e < 4; ++e) {
                        int qi = nb * 8 + (lane % 4) * 2 + (e & 1), hr = e >> 1;
                        bool ok = visible(key_row[hr], spos[qi], w, L) || (spos[qi] >= 0 && ((far[hr] >> (nb * 8 + (e & 1))) & 1));
                        if (ok && key_row[hr] < L) cov[(size_t)spos[qi] * L + key_row[hr]] = 1;
                    }
                }
            }
        }
    });
}
int walks() {
    fails = 0;
    int cases[][2] = {{300, 16}, {200, 7}, {517, 64}, {130, 1}, {2048, 64}, {4100, 128}, {1000, 5}, {777, 200}, {64, 64}, {65, 1}};
    double ps[] = {0.25, 0.5, 0.6, 0.75, 0.9, 0.125};
    auto powers = [](int L, int w, double pw) {
        std::vector<int> offs;
        for (int d = w; d < L; ++d)
            if (is_off(d, pw)) offs.push_back(d);
        return offs;
    };
    for (auto& c : cases) for (double pw : ps) check(c[0], c[1], powers(c[0], c[1], pw), pw);
    std::mt19937 rng(7);
    for (int i = 0; i < 150; ++i) {
        const int L = 60 + rng() % 1400, w = 1 + rng() % 300;
        const double pw = 0.05 + (rng() % 90) / 100.0;
        check(L, w, powers(L, w, pw), pw);
    }
    // Random far sets of every density, and tiny lengths around a word and a tile.
    for (int i = 0; i < 150; ++i) {
        const int L = 1 + rng() % 700, w = 1 + rng() % 100, every = 1 + rng() % 200;
        std::vector<int> offs;
        for (int d = w; d < L; ++d)
            if (rng() % every == 0) offs.push_back(d);
        check(L, w, offs, -1);
    }
    for (int L : {1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129})
        for (int w : {1, 2, 64})
            check(L, w, powers(L, w, 0.5), 0.5);
    return fails;
}

// sees_any and far_bits64 against brute force on random far sets.
int helpers() {
    std::mt19937 rng(3);
    int fails = 0;
    for (int it = 0; it < 200; ++it) {
        const int L = 1 + rng() % 300, w = 1 + rng() % 80;
        std::vector<int> offs;
        std::vector<char> far(L, 0);
        for (int d = w; d < L; ++d)
            if (rng() % 7 == 0) far[d] = 1, offs.push_back(d);
        const std::vector<int> table = build_table(offs, L, w);
        const Shape p{table.data(), L, w};
        for (int dlo = -70; dlo < L + 70; ++dlo)
            for (int dhi = dlo - 3; dhi < dlo + 140; ++dhi) {
                bool want = false;
                for (int d = std::max(dlo, 0); d <= std::min(dhi, L - 1); ++d) want |= d < w || far[d];
                fails += sees_any(p, dlo, dhi, w) != want;
            }
        for (int d0 = -100; d0 < L + 10; ++d0) {
            const uint64_t b = far_bits64(p, d0);
            for (int i = 0; i < 64; ++i) {
                const int d = d0 + i;
                fails += (int)((b >> i) & 1) != (d >= 0 && d < L && (d < w || far[d]));
            }
        }
    }
    if (fails) printf("FAIL sees_any / far_bits64: %d mismatches\n", fails);
    return fails;
}

// Least-squares slope of ln y against ln x.
double log_slope(const std::vector<double>& x, const std::vector<double>& y) {
    double mx = 0, my = 0, sxy = 0, sxx = 0;
    for (size_t i = 0; i < x.size(); ++i) mx += std::log(x[i]) / x.size(), my += std::log(y[i]) / y.size();
    for (size_t i = 0; i < x.size(); ++i) {
        sxy += (std::log(x[i]) - mx) * (std::log(y[i]) - my);
        sxx += (std::log(x[i]) - mx) * (std::log(x[i]) - mx);
    }
    return sxy / sxx;
}

// The tiles the sm90 forward's block walk (first_tile / next_tile) and its warpgroups' checks
// (sees_any) visit, against all causal tiles, for PPA w = 64.
void tiles() {
    const int w = 64, BQ = 128, BK = 64;
    printf("p,L,block_tiles,warpgroup_tiles,causal_block_tiles,causal_warpgroup_tiles\n");
    for (double pw : {0.25, 0.5, 0.75}) {
        std::vector<double> ls, blocks, groups;
        for (int L : {4096, 8192, 16384, 32768}) {
            std::vector<int> offs;
            for (int d = w; d < L; ++d)
                if (is_off(d, pw)) offs.push_back(d);
            const std::vector<int> table = build_table(offs, L, w);
            const Shape p{table.data(), L, w};
            long nb = 0, ng = 0, cb = 0, cg = 0;
            for (int row0 = 0; row0 < L; row0 += BQ) {
                int spos[BQ];
                for (int i = 0; i < BQ; ++i) spos[i] = row0 + i < L ? row0 + i : -1;
                const int last = std::min(row0 + BQ, L) - 1 - row0;
                const RowSpan span = row_span(spos, 0, last, -1 - row0, w, L);
                cb += span.key_hi / BK + 1;
                for (int t = first_tile(p, span, BK); t <= span.key_hi / BK; t = next_tile(p, t, span, BK)) {
                    ++nb;
                    for (int wg = 0; wg * 64 <= last; ++wg) {
                        const RowSpan ws = row_span(spos, wg * 64, std::min(wg * 64 + 63, last), -1 - row0, w, L);
                        ng += sees_any(p, ws.pmin - (t * BK + BK - 1), ws.key_hi - t * BK, w);
                    }
                }
                for (int wg = 0; wg * 64 <= last; ++wg) cg += std::min(row0 + wg * 64 + 63, L - 1) / BK + 1;
            }
            printf("%g,%d,%ld,%ld,%ld,%ld\n", pw, L, nb, ng, cb, cg);
            ls.push_back(L), blocks.push_back(nb), groups.push_back(ng);
        }
        printf("# p=%g: fitted exponent, block tiles %.2f, warpgroup tiles %.2f\n", pw, log_slope(ls, blocks),
               log_slope(ls, groups));
    }
}

int main(int argc, char** argv) {
    if (argc > 1 && std::string(argv[1]) == "--tiles") {
        tiles();
        return 0;
    }
    const int f = walks() + helpers();
    printf("%d failures\n", f);
    return f != 0;
}
