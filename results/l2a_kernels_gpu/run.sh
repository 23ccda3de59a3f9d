#!/bin/sh
# L2A training through the CUDA kernels against the reference attention path: same seed, same
# data, bf16 on one GPU; the two train_log.csv files land here as l2a_cuda.csv and
# l2a_reference.csv. Usage (repository root): results/l2a_kernels_gpu/run.sh [attnsweep binary]
set -eu
B=${1:-attnsweep}
HERE=$(dirname "$0")
WORK=${TMPDIR:-/tmp}/l2a_kernels_gpu
rm -rf "$WORK" && mkdir -p "$WORK"
"$B" data synth --out "$WORK/data" --train-tokens 4000000 --val-tokens 131072 --max-distance 2048
for impl in reference cuda; do
    "$B" train -q --out "$WORK/$impl" \
        --set data.dir="$WORK/data" --set data.seq_len=2048 \
        --set model.hidden_size=512 --set model.intermediate_size=1536 \
        --set model.num_hidden_layers=4 --set model.num_attention_heads=8 \
        --set attention.method=l2a --set attention.window=128 --set attention.lambda=0.05 \
        --set attention.attn_impl=$impl \
        --set train.steps=200 --set train.batch_size=8 --set train.lr=1e-3 \
        --set train.seed=1337 --set train.dtype=bf16 --set train.device=cuda --set train.log_every=10
    cp "$WORK/$impl/train_log.csv" "$HERE/l2a_$impl.csv"
done
