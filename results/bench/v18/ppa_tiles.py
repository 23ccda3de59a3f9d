"""How PPA's pairs fall into square tiles of contiguous queries and keys (128 x 128, as the sm90
forward tiles the dense causal pass, and 64 x 64) at L 16384 and window 64: of the causal triangle's tiles, how many hold a
pair PPA sees (a kernel that skips empty tiles still visits these), how full they are, and how
many are almost full (>= 90 %: the ones a dense-tile path would run unmasked).

PPA's distances: d < window, or d in S_p, floor(d^p) - floor((d-1)^p) = 1 (0^p = 0), the
definition of kernels/bench_peers.py. Writes ppa_tiles.csv beside this file; needs no GPU.
    python3 results/bench/v18/ppa_tiles.py
"""

import csv
import math
import os

L, WINDOW = 16384, 64


def power_offset(j, p):
    if j == 0:
        return False
    fl = lambda x: math.floor(x**p + 1e-9 * max(x**p, 1.0)) if x > 0 else (1 if p == 0 else 0)
    return fl(j) - fl(j - 1) == 1


def row(p, T):
    seen = [d < WINDOW or power_offset(d, p) for d in range(L)]
    n = L // T
    causal_tiles = visited = full90 = 0
    seen_pairs = visited_pairs = 0
    for delta in range(n):  # query block minus key block
        count = n - delta  # tiles at this offset
        s = cap = 0
        for t in range(-(T - 1), T):
            d = T * delta + t
            if d < 0:
                continue
            pairs = T - abs(t)
            cap += pairs
            s += pairs * seen[d] if d < L else 0
        causal_tiles += count
        if s > 0:
            visited += count
            visited_pairs += count * cap
            seen_pairs += count * s
            if s >= 0.9 * cap:
                full90 += count
    causal_pairs = L * (L + 1) // 2
    return {
        "p": p,
        "tile": T,
        "causal_tiles": causal_tiles,
        "visited_tiles": visited,
        "visited_share": f"{visited / causal_tiles:.4f}",
        "seen_share_of_causal_pairs": f"{seen_pairs / causal_pairs:.4f}",
        "seen_share_in_visited_tiles": f"{seen_pairs / visited_pairs:.4f}",
        "tiles_at_least_90pct_full": full90,
        "almost_full_share_of_visited": f"{full90 / visited:.4f}",
    }


rows = [row(p, t) for t in (128, 64) for p in (0.5, 0.75, 0.875)]
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ppa_tiles.csv")
with open(out, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
for r in rows:
    print(r)
