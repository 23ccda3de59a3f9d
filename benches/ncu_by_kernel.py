"""Sums the GPU time of each kernel in an Nsight Compute CSV log, most expensive first:
the per-kernel profiles quoted in PERFORMANCE.md.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file prof.csv \
        attnsweep bench train --lengths 32768 --methods swa --steps 1 --warmup 1 --no-peers
    python3 benches/ncu_by_kernel.py prof.csv [rows]
"""

import collections
import csv
import sys


def main():
    path = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 45
    total, count = collections.defaultdict(float), collections.Counter()
    with open(path) as f:
        # ncu writes its own notes before the CSV; the CSV lines are the quoted ones.
        lines = [line for line in f if line.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"][:110]
        total[name] += float(r["Metric Value"].replace(",", "")) / 1e6  # ns to ms
        count[name] += 1
    print(f"total {sum(total.values()):.2f} ms over {sum(count.values())} kernels")
    for name, ms in sorted(total.items(), key=lambda x: -x[1])[:rows]:
        print(f"{ms:9.3f} ms {count[name]:6d}  {name}")


if __name__ == "__main__":
    main()
