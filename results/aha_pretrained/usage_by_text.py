"""AHA Fig. 3 on the pretrained base: how far a cell's per-head usage on each probe task follows
its usage on the corpus. For every probes_aha cell, the Pearson correlation over the 270
(layer, head) pairs between the usage on a task's prompts (eval/probe_head_usage.csv) and on the
validation text of the cell it evaluates (eval/head_usage.csv), with each map's mean.
Run from this folder after the sweep: python3 usage_by_text.py > usage_by_text.csv
"""

import csv
import json
import math


def corr(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    sa = math.sqrt(sum((x - ma) ** 2 for x in a))
    sb = math.sqrt(sum((y - mb) ** 2 for y in b))
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (sa * sb)


def usage(path, task=None):
    out = {}
    for r in csv.DictReader(open(path)):
        if task is None or r["task"] == task:
            out[(int(r["layer"]), int(r["head"]))] = float(r["mu_f"])
    return out


print("cell,label,task,correlation_with_text,task_mean_mu_f,text_mean_mu_f")
for c in json.load(open("cells.json")):
    if c["stage"] != "probes_aha":
        continue
    text = usage(f"{c['depends_on']}/eval/head_usage.csv")
    keys = sorted(text)
    tasks = sorted({r["task"] for r in csv.DictReader(open(f"{c['id']}/eval/probe_head_usage.csv"))})
    for t in tasks:
        m = usage(f"{c['id']}/eval/probe_head_usage.csv", t)
        r = corr([text[k] for k in keys], [m[k] for k in keys])
        print(f"{c['id']},{c['label']},{t},{r:.4f},{sum(m.values()) / len(m):.4f},{sum(text.values()) / len(text):.4f}")
