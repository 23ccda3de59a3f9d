#!/bin/sh
# L2A training through the CUDA kernels against the reference attention path: same seed, same
# data, bf16 on one GPU; the two train_log.csv files land here as l2a_cuda.csv and
# l2a_reference.csv. Usage (repository root): results/l2a_kernels_gpu/run.sh [attnsweep binary]
set -eu
HERE=$(dirname "$0")
A="--set attention.method=l2a --set attention.window=128 --set attention.lambda=0.05"
exec "$HERE/../../benches/kernel_curves.sh" "${1:-attnsweep}" "$HERE" 2048 8 1337 \
    l2a_reference "$A --set attention.attn_impl=reference" \
    l2a_cuda "$A --set attention.attn_impl=cuda"
