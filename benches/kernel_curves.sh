#!/bin/sh
# Trains one small model (4 layers, d_model 512, 8 heads, SwiGLU 1536, 200 steps, lr 1e-3,
# bf16, one GPU) on one synthetic dataset once per variant, a variant being a name and its
# extra `--set` flags; each run's train_log.csv lands in OUT as NAME.csv. The kernel path
# against the reference path: results/*_kernels_gpu/run.sh.
# Usage: benches/kernel_curves.sh BINARY OUT SEQ_LEN BATCH SEED NAME "FLAGS" [NAME "FLAGS" ...]
set -eu
B=$1 OUT=$2 LEN=$3 BATCH=$4 SEED=$5
shift 5
[ $(($# % 2)) -eq 0 ] || { echo "kernel_curves.sh: variants come as NAME \"FLAGS\" pairs" >&2; exit 2; }
WORK=${TMPDIR:-/tmp}/kernel_curves_$(basename "$OUT")
rm -rf "$WORK" && mkdir -p "$WORK"
"$B" data synth --out "$WORK/data" --train-tokens 4000000 --val-tokens 131072 --max-distance "$LEN"
while [ $# -ge 2 ]; do
    name=$1 flags=$2
    shift 2
    # $flags unquoted: whitespace-separated `--set key=value` pairs.
    "$B" train -q --out "$WORK/$name" \
        --set data.dir="$WORK/data" --set data.seq_len="$LEN" \
        --set model.hidden_size=512 --set model.intermediate_size=1536 \
        --set model.num_hidden_layers=4 --set model.num_attention_heads=8 \
        --set train.steps=200 --set train.batch_size="$BATCH" --set train.lr=1e-3 \
        --set train.seed="$SEED" --set train.dtype=bf16 --set train.device=cuda \
        --set train.log_every=10 $flags
    cp "$WORK/$name/train_log.csv" "$OUT/$name.csv"
done
