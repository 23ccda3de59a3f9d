#!/bin/sh
# Attention sinks on the GPU: every GPU test (the sink pair kernels against the dense
# reference, forward and backward; every method's examples trained through the kernels against
# the reference path), then the training bench of SWA and sinks beside their compiled PyTorch
# peers (FlexAttention block masks), three times. Writes gpu_tests.txt and bench_r{1,2,3}.csv
# here.
# Usage (repository root, a GPU machine): results/sinks_kernels_gpu/run.sh <attnsweep> <unit tests>
#   <unit tests>: the library's test binary (`cargo test --release --lib --no-run` names it).
set -eu
BIN=${1:-attnsweep}
UNIT=$2
HERE=$(dirname "$0")
"$BIN" kernels build
"$UNIT" --ignored --test-threads 1 > "$HERE/gpu_tests.txt" 2>&1
for r in 1 2 3; do
  "$BIN" bench train --model smollm2-135m --lengths 8192 --tokens 32768 --methods swa,sinks \
    --window 1024 --peers compile --steps 8 --warmup 3 --out "/tmp/sinks_bench_r$r"
  cp "/tmp/sinks_bench_r$r/train_bench.csv" "$HERE/bench_r$r.csv"
done
