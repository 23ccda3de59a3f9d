"""AHA Fig. 4 on the pretrained base: how concentrated full-attention calls are over heads. For every
AHA cell's 270 heads on the validation text (aha_gaps.csv, rows at eval_seq_len 2048; the
probes_aha cells are the same models evaluated again), the share
of all full-attention calls that the most-used 10 %, 25 % and 50 % of heads make, beside what
heads of equal usage would make (10 %, 25 %, 50 %).
Run from this folder: python3 usage_concentration.py > usage_concentration.csv
"""

import csv
from collections import defaultdict

heads = defaultdict(list)
label = {}
for r in csv.DictReader(open("aha_gaps.csv")):
    if float(r["eval_seq_len"]) == 2048:
        heads[r["cell"]].append(float(r["mu_f"]))
        label[r["cell"]] = (float(r["window"]), float(r["lambda"]))

print("cell,window,lambda,heads,mean_mu_f,top10_share,top25_share,top50_share")
for cell in sorted(heads, key=lambda c: (label[c], c)):
    mu = sorted(heads[cell], reverse=True)
    total = sum(mu)
    # A cell whose gates never opened makes no calls to share out.
    share = [sum(mu[: round(len(mu) * q)]) / total if total else None for q in (0.10, 0.25, 0.50)]
    w, lam = label[cell]
    print(f"{cell},{w:g},{lam:g},{len(mu)},{total / len(mu):.4f},"
          + ",".join("" if s is None else f"{s:.4f}" for s in share))
