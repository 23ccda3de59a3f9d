#!/usr/bin/env bash
# Training throughput of a small model (8 layers, d_model 512, 8 heads, bf16) on a GPU, for
# full, SWA (w=256) and PPA (p=0.5, w=256) attention at L=2048 and L=8192, on
# the synthetic corpus. Usage: benches/gpu_train_throughput.sh [path/to/attnsweep] [outdir]
# Prints one line per run: the last train_log.csv row (step, loss, lr, grad_norm, tokens/s, tokens).
set -u
B=${1:-target/release/attnsweep}
OUTDIR=${2:-/tmp/attnsweep-throughput}
mkdir -p "$OUTDIR"
[ -f "$OUTDIR/data/meta.json" ] || "$B" data synth --out "$OUTDIR/data" --train-tokens 4000000 --val-tokens 100000 --max-distance 8192
M="--set model.hidden_size=512 --set model.intermediate_size=1536 --set model.num_hidden_layers=8 --set model.num_attention_heads=8 --set model.num_key_value_heads=8"
for L in 2048 8192; do
  BS=$((65536 / L))
  for m in full swa ppa; do
    rm -rf "$OUTDIR/r_${m}_$L"
    "$B" train -q --out "$OUTDIR/r_${m}_$L" --set data.dir="$OUTDIR/data" --set data.seq_len=$L $M \
      --set train.batch_size=$BS --set train.steps=60 --set train.warmup_steps=5 --set train.log_every=20 \
      --set train.dtype=bf16 --set attention.method=$m --set attention.window=256 --set attention.ppa_power=0.5 \
      --set eval.max_batches=2 --set eval.batch_size=2
    echo "L=$L method=$m batch=$BS: $(tail -1 "$OUTDIR/r_${m}_$L/train_log.csv")"
  done
done
