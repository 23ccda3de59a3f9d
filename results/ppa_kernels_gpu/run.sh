#!/bin/sh
# PPA training (p = 0.5, w = 64) through the kernel path (window kernels plus the power-offset
# kernels, fused cross-entropy, RMSNorm, rotary embedding and AdamW) against the reference path
# (a dense PPA mask through SDPA): same seed, same data, bf16 on one GPU, L = 8192 (where the
# pattern is sparse enough, 3% of the causal pairs, for the model to pick the offset kernels).
# The train_log.csv files land here as ppa_reference.csv and ppa_cuda.csv (seed 1337), or
# ppa_reference_seedN.csv and ppa_cuda_seedN.csv for another seed N.
# Usage (repository root): results/ppa_kernels_gpu/run.sh [attnsweep binary] [seed]
set -eu
B=${1:-attnsweep}
SEED=${2:-1337}
SUFFIX=$([ "$SEED" = 1337 ] || echo "_seed$SEED")
HERE=$(dirname "$0")
WORK=${TMPDIR:-/tmp}/ppa_kernels_gpu
rm -rf "$WORK" && mkdir -p "$WORK"
"$B" data synth --out "$WORK/data" --train-tokens 4000000 --val-tokens 131072 --max-distance 8192
for impl in reference cuda; do
    "$B" train -q --out "$WORK/$impl" \
        --set data.dir="$WORK/data" --set data.seq_len=8192 \
        --set model.hidden_size=512 --set model.intermediate_size=1536 \
        --set model.num_hidden_layers=4 --set model.num_attention_heads=8 \
        --set attention.method=ppa --set attention.ppa_power=0.5 --set attention.window=64 \
        --set attention.attn_impl=$impl \
        --set train.steps=200 --set train.batch_size=2 --set train.lr=1e-3 \
        --set train.seed=$SEED --set train.dtype=bf16 --set train.device=cuda --set train.log_every=10
    cp "$WORK/$impl/train_log.csv" "$HERE/ppa_$impl$SUFFIX.csv"
done
