#!/bin/sh
# AHA training through the kernel path (routed attention kernels, fused cross-entropy,
# RMSNorm, rotary embedding and AdamW) against the reference path: same seed, same data, bf16
# on one GPU, the exact straight-through gradient; then the kernel path with the sampled
# gradient (attention.ste_sample = 0.25). The train_log.csv files land here as
# aha_reference.csv, aha_cuda.csv and aha_cuda_ste0.25.csv.
# Usage (repository root): results/aha_kernels_gpu/run.sh [attnsweep binary]
set -eu
HERE=$(dirname "$0")
A="--set attention.method=aha --set attention.window=128 --set attention.lambda=0.01"
exec "$HERE/../../benches/kernel_curves.sh" "${1:-attnsweep}" "$HERE" 2048 8 1337 \
    aha_reference "$A --set attention.attn_impl=reference" \
    aha_cuda "$A --set attention.attn_impl=cuda" \
    aha_cuda_ste0.25 "$A --set attention.attn_impl=cuda --set attention.ste_sample=0.25"
