#!/bin/sh
# Qwen2.5-1.5B's shape at L 8,192, 16,384 tokens a step (batch 2): ours and the compiled peer
# side by side, each with the checkpointing it needs (on an H200 the peer needs none). Run three
# times, the GPU to itself; run<N>.csv is each run's train_bench.csv, run<N>.log its output.
set -eu
for n in 1 2 3; do
    attnsweep bench train --model qwen2.5-1.5b --lengths 8192 --tokens 16384 --methods full \
        --steps 5 --warmup 2 --peers compile --out "qb$n" > "run$n.log" 2>&1
    cp "qb$n/train_bench.csv" "run$n.csv"
done
