"""Sums the GPU time of each kernel in an Nsight Compute CSV log, most expensive first:
the per-kernel profiles quoted in PERFORMANCE.md.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file prof.csv \
        attnsweep bench train --lengths 32768 --methods swa --steps 1 --warmup 1 --no-peers
    python3 benches/ncu_by_kernel.py prof.csv [rows] [--last-step]

--last-step keeps the kernels after the second-to-last optimizer kernel up to the last one:
exactly the final training step (forward, backward, optimizer), without the warm-up steps or
a method's calibration forwards.
"""

import collections
import csv
import sys


def main():
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    if any(f != "--last-step" for f in flags):
        sys.exit(f"unknown flag among {flags}; the only flag is --last-step")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = args[0]
    rows = int(args[1]) if len(args) > 1 else 45
    with open(path) as f:
        # ncu writes its own notes before the CSV; the CSV lines are the quoted ones.
        lines = [line for line in f if line.startswith('"')]
    launches = [
        (r["Kernel Name"][:110], float(r["Metric Value"].replace(",", "")) / 1e6)  # ns to ms
        for r in csv.DictReader(lines)
        if r.get("Metric Name") == "gpu__time_duration.sum"
    ]
    if flags:
        steps = [i for i, (name, _) in enumerate(launches) if "adamw_kernel" in name]
        if len(steps) < 2:
            sys.exit(f"{path}: --last-step needs two optimizer steps, found {len(steps)}")
        launches = launches[steps[-2] + 1 : steps[-1] + 1]
    total, count = collections.defaultdict(float), collections.Counter()
    for name, ms in launches:
        total[name] += ms
        count[name] += 1
    print(f"total {sum(total.values()):.2f} ms over {sum(count.values())} kernels")
    for name, ms in sorted(total.items(), key=lambda x: -x[1])[:rows]:
        print(f"{ms:9.3f} ms {count[name]:6d}  {name}")


if __name__ == "__main__":
    main()
