#!/bin/sh
# PPA training (p = 0.5, w = 64) through the kernel path (PPA attention kernels, fused
# cross-entropy, RMSNorm, rotary embedding and AdamW) against the reference path (a dense PPA
# mask through SDPA): same seed, same data, bf16 on one GPU, L = 8192.
# The train_log.csv files land here as ppa_reference.csv and ppa_cuda.csv (seed 1337), or
# ppa_reference_seedN.csv and ppa_cuda_seedN.csv for another seed N.
# Usage (repository root): results/ppa_kernels_gpu/run.sh [attnsweep binary] [seed]
set -eu
HERE=$(dirname "$0")
SEED=${2:-1337}
SUFFIX=$([ "$SEED" = 1337 ] || echo "_seed$SEED")
A="--set attention.method=ppa --set attention.ppa_power=0.5 --set attention.window=64"
exec "$HERE/../../benches/kernel_curves.sh" "${1:-attnsweep}" "$HERE" 8192 2 "$SEED" \
    "ppa_reference$SUFFIX" "$A --set attention.attn_impl=reference" \
    "ppa_cuda$SUFFIX" "$A --set attention.attn_impl=cuda"
