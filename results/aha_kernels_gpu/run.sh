#!/bin/sh
# AHA training through the kernel path (routed attention kernels, fused cross-entropy,
# RMSNorm, rotary embedding and AdamW) against the reference path: same seed, same data, bf16
# on one GPU, the exact straight-through gradient; then the kernel path with the sampled
# gradient (attention.ste_sample = 0.25). The train_log.csv files land here as
# aha_reference.csv, aha_cuda.csv and aha_cuda_ste0.25.csv.
# Usage (repository root): results/aha_kernels_gpu/run.sh [attnsweep binary]
set -eu
B=${1:-attnsweep}
HERE=$(dirname "$0")
WORK=${TMPDIR:-/tmp}/aha_kernels_gpu
rm -rf "$WORK" && mkdir -p "$WORK"
"$B" data synth --out "$WORK/data" --train-tokens 4000000 --val-tokens 131072 --max-distance 2048
run() {
    name=$1
    shift
    "$B" train -q --out "$WORK/$name" \
        --set data.dir="$WORK/data" --set data.seq_len=2048 \
        --set model.hidden_size=512 --set model.intermediate_size=1536 \
        --set model.num_hidden_layers=4 --set model.num_attention_heads=8 \
        --set attention.method=aha --set attention.window=128 --set attention.lambda=0.01 \
        --set train.steps=200 --set train.batch_size=8 --set train.lr=1e-3 \
        --set train.seed=1337 --set train.dtype=bf16 --set train.device=cuda --set train.log_every=10 \
        "$@"
    cp "$WORK/$name/train_log.csv" "$HERE/$name.csv"
}
run aha_reference --set attention.attn_impl=reference
run aha_cuda --set attention.attn_impl=cuda
run aha_cuda_ste0.25 --set attention.attn_impl=cuda --set attention.ste_sample=0.25
