"""Tables and figures of results/multi_gpu from the runs' own files (run.sh writes them):
train_log.csv copies `tp_g<G>_r<R>.csv` (SmolLM2-135M's shape, G GPUs, run R) and
`q_g<G>_r<R>.csv` (Qwen2.5-1.5B's), the peer's rows `peer_g<G>.csv`, and the loss-curve logs
`lc_g<G>_s<S>.csv` (G GPUs, seed S).

Writes throughput.csv (every run: the median tokens/s of its steps after the first 5),
scaling.csv (per shape, implementation and GPU count: mean, 95 % t-interval, speed-up over
one GPU paired run by run), curves.csv (the loss of every curve at every step),
curve_gaps.csv, sweeps.csv (a grid with one and two GPUs a cell), and the figures
speedup.svg and loss_curves.svg. Python's standard library
only.

    python3 summarize.py      # in results/multi_gpu
"""

import csv
import glob
import math
import os
import re
import statistics

WARMUP = 5  # steps left out of a run's rate: the first include start-up and compilation
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def interval(xs):
    """Mean and the half-width of its 95 % t-interval (None for one value)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, None
    return m, T975[len(xs) - 1] * statistics.stdev(xs) / math.sqrt(len(xs))


SHAPES = [("tp", "SmolLM2-135M, L 2,048"), ("q", "Qwen2.5-1.5B, L 8,192")]


def ours(prefix):
    """{gpus: [tokens/s of each run, in run order]} of the runs `<prefix>_g<G>_r<R>.csv`."""
    out = {}
    for path in sorted(glob.glob(f"{prefix}_g*_r*.csv")):
        g, r = map(int, re.match(rf"{prefix}_g(\d+)_r(\d+)\.csv", os.path.basename(path)).groups())
        rates = [float(x["tokens_per_s"]) for x in rows(path) if int(x["step"]) > WARMUP]
        out.setdefault(g, []).append((r, statistics.median(rates)))
    return {g: [v for _, v in sorted(runs)] for g, runs in out.items()}


def peer():
    """{gpus: tokens/s}, from the peer's CSV rows (impl,method,L,batch,step_ms,tokens_per_s,...)."""
    out = {}
    for path in sorted(glob.glob("peer_g*.csv")):
        g = int(re.match(r"peer_g(\d+)\.csv", os.path.basename(path)).group(1))
        for line in open(path):
            f = line.strip().split(",")
            if len(f) > 5 and f[5]:
                out[g] = float(f[5])
    return out


def write_tables(shapes, p):
    """shapes: [(name, {gpus: [tokens/s]})]; p: the peer's {gpus: tokens/s} (the first shape's)."""
    with open("throughput.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "impl", "gpus", "run", "tokens_per_s"])
        for name, o in shapes:
            for g, runs in sorted(o.items()):
                for r, v in enumerate(runs, 1):
                    w.writerow([name, "attnsweep", g, r, f"{v:.0f}"])
        for g, v in sorted(p.items()):
            w.writerow([shapes[0][0], "torch_compile_ddp", g, 1, f"{v:.0f}"])
    with open("scaling.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "impl", "gpus", "runs", "tokens_per_s", "ci95", "speedup", "speedup_ci95", "vs_peer"])
        for i, (name, o) in enumerate(shapes):
            for g, runs in sorted(o.items()):
                m, h = interval(runs)
                s, sh = interval([a / b for a, b in zip(runs, o[1])])
                vs = f"{m / p[g]:.3f}" if i == 0 and g in p else ""
                w.writerow([name, "attnsweep", g, len(runs), f"{m:.0f}", "" if h is None else f"{h:.0f}",
                            f"{s:.3f}", "" if sh is None else f"{sh:.3f}", vs])
        for g, v in sorted(p.items()):
            w.writerow([shapes[0][0], "torch_compile_ddp", g, 1, f"{v:.0f}", "", f"{v / p[1]:.3f}", "", ""])


def curves():
    """{(gpus, seed): [(step, loss)]}."""
    out = {}
    for path in sorted(glob.glob("lc_g*_s*.csv")):
        if path.endswith("_val.csv"):
            continue
        g, s = map(int, re.match(r"lc_g(\d+)_s(\d+)\.csv", os.path.basename(path)).groups())
        out[(g, s)] = [(int(x["step"]), float(x["loss"])) for x in rows(path)]
    return out


def write_curves(c):
    keys = sorted(c)
    steps = sorted({s for k in keys for s, _ in c[k]})
    with open("curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"loss_g{g}_s{s}" for g, s in keys])
        for st in steps:
            w.writerow([st] + [f"{dict(c[k]).get(st, float('nan')):.6f}" for k in keys])
    # The two-GPU curve against one GPU's at the same seed, beside one GPU's two seeds.
    def gap(a, b):
        da, db = dict(c[a]), dict(c[b])
        common = [s for s in da if s in db]
        return statistics.mean(abs(da[s] - db[s]) for s in common), len(common)
    with open("curve_gaps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["compared", "steps", "mean_abs_loss_gap"])
        for a, b, name in [((2, 1), (1, 1), "2 GPUs vs 1 GPU, seed 1"), ((1, 2), (1, 1), "1 GPU seed 2 vs seed 1")]:
            if a in c and b in c:
                m, n = gap(a, b)
                w.writerow([name, n, f"{m:.5f}"])


# ---- SVG: a line chart with labelled ticks, markers, and its legend beside the data ----

COLOURS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7"]  # Okabe-Ito, colour-blind safe


def svg_chart(path, title, xlabel, ylabel, series, xticks, ref=None):
    """series: [(label, [(x, y)], marker)], marker True (dots), "wide" (a broad line beneath)
    or False; ref: (label, [(x, y)]) drawn dashed."""
    W, H, L, R, T, B = 920, 440, 80, 360, 50, 60
    pts = [p for _, s, _ in series for p in s] + (ref[1] if ref else [])
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    pad = (y1 - y0) * 0.08 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    if x1 == x0:
        x1 = x0 + 1
    X = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)
    Y = lambda y: H - B - (y - y0) / (y1 - y0) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="13">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="28" text-anchor="middle" font-size="16">{title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 18}" text-anchor="middle">{xlabel}</text>',
           f'<text x="20" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 20 {(T + H - B) / 2})">{ylabel}</text>']
    for x in xticks:
        out.append(f'<line x1="{X(x)}" y1="{H - B}" x2="{X(x)}" y2="{H - B + 5}" stroke="black"/>')
        out.append(f'<text x="{X(x)}" y="{H - B + 20}" text-anchor="middle">{x:g}</text>')
    # Ticks at round values: the step of 1, 2, 2.5 or 5 times a power of ten giving 4 to 8.
    raw = (y1 - y0) / 6
    power = 10 ** math.floor(math.log10(raw))
    step = min((m * power for m in (1, 2, 2.5, 5, 10)), key=lambda v: abs((y1 - y0) / v - 6))
    y = math.ceil(y0 / step) * step
    while y <= y1:
        out.append(f'<line x1="{L - 5}" y1="{Y(y)}" x2="{L}" y2="{Y(y)}" stroke="black"/>')
        label = f"{y / 1e3:.0f}k" if abs(y1) >= 1e4 else f"{y:g}"
        out.append(f'<text x="{L - 8}" y="{Y(y) + 4}" text-anchor="end">{label}</text>')
        y += step
    entries = []
    if ref:
        d = " ".join(f"{X(x)},{Y(y)}" for x, y in ref[1])
        out.append(f'<polyline points="{d}" fill="none" stroke="#777" stroke-dasharray="6 4"/>')
        entries.append((ref[0], "#777", None, True))
    # A series marked "wide" is drawn broad underneath, so one that lies on it shows both.
    for i, (label, s, marker) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        width = 6 if marker == "wide" else 2
        d = " ".join(f"{X(x)},{Y(y)}" for x, y in s)
        out.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="{width}" stroke-opacity="{0.5 if width > 2 else 1}"/>')
        if marker is True:
            for x, y in s:
                out.append(f'<circle cx="{X(x)}" cy="{Y(y)}" r="5" fill="{colour}"/>')
        entries.append((label, colour, marker, False))
    for i, (label, colour, marker, dashed) in enumerate(entries):
        y = T + 20 + 24 * i
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        width = 6 if marker == "wide" else 2
        out.append(f'<line x1="{W - R + 15}" y1="{y}" x2="{W - R + 45}" y2="{y}" stroke="{colour}" stroke-width="{width}"{dash}/>')
        if marker is True:
            out.append(f'<circle cx="{W - R + 30}" cy="{y}" r="5" fill="{colour}"/>')
        out.append(f'<text x="{W - R + 52}" y="{y + 4}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_sweeps():
    """sweeps.csv: each cell of the grid run with --gpus-per-cell 1 and 2, side by side."""
    if not (os.path.exists("sweep_1_summary.csv") and os.path.exists("sweep_2_summary.csv")):
        return
    one = {r["cell"]: r for r in rows("sweep_1_summary.csv")}
    two = {r["cell"]: r for r in rows("sweep_2_summary.csv")}
    with open("sweeps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", "label", "loss_1gpu", "loss_2gpus", "same_loss", "tokens_per_s_1gpu", "tokens_per_s_2gpus"])
        for c, r in one.items():
            t = two.get(c, {})
            w.writerow([c, r["label"], r["loss"], t.get("loss", ""), r["loss"] == t.get("loss"),
                        r["tokens_per_s"], t.get("tokens_per_s", "")])


def main():
    write_sweeps()
    shapes = [(name, ours(prefix)) for prefix, name in SHAPES if glob.glob(f"{prefix}_g*.csv")]
    p = peer()
    write_tables(shapes, p)
    gpus = sorted({g for _, o in shapes for g in o})
    series = [(f"attnsweep, {name}", [(g, statistics.mean(a / b for a, b in zip(o[g], o[1]))) for g in sorted(o)], True)
              for name, o in shapes]
    if p:
        series.append((f"torch.compile + DDP, {shapes[0][0]}", [(g, v / p[1]) for g, v in sorted(p.items())], True))
    svg_chart("speedup.svg", "Data-parallel speed-up over one GPU (2 x H200, NVLink)",
              "GPUs", "tokens/s over one GPU's", series, gpus, ("ideal (x GPUs)", [(g, g) for g in gpus]))
    c = curves()
    if c:
        write_curves(c)
        labels = {k: f"{k[0]} GPU{'s' if k[0] > 1 else ''}, seed {k[1]}" for k in c}
        # One GPU's seed-1 curve broad beneath two GPUs' (the same seed), which lies on it.
        series = [(labels[k], c[k], "wide" if k == (1, 1) else False) for k in sorted(c)]
        steps = [s for s, _ in c[sorted(c)[0]]]
        ticks = [s for s in steps if s % 20 == 0]
        svg_chart("loss_curves.svg", "Training loss at one global batch (32 x 2,048 tokens)",
                  "step", "training loss", series, ticks)


if __name__ == "__main__":
    main()
