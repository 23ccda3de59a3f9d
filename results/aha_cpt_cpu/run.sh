#!/usr/bin/env bash
# AHA continued pretraining from a full-attention base on the synthetic corpus, on the CPU:
# full-attention usage mu_f and validation loss against the window w and the penalty lambda
# (AHA Tables 1 and 4, small scale). Usage: results/aha_cpt_cpu/run.sh [attnsweep] [workdir]
# Writes table.csv beside this script.
set -euo pipefail
B=${1:-target/release/attnsweep}
W=${2:-runs/aha_cpt_cpu}
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL="--set data.seq_len=64 --set model.hidden_size=64 --set model.intermediate_size=128 --set model.num_hidden_layers=2"
[ -f "$W/data/meta.json" ] || "$B" data synth --out "$W/data" --train-tokens 300000 --val-tokens 32768 --max-distance 64 --event-rate 0.08
[ -f "$W/base/eval/eval.json" ] || "$B" train -q --out "$W/base" --set data.dir="$W/data" $MODEL \
  --set train.steps=2000 --set train.warmup_steps=50 --set train.lr=5e-3 --set eval.max_batches=0
cell() { # name window lambda
  [ -f "$W/$1/eval/eval.json" ] || "$B" train -q --out "$W/$1" --init-from "$W/base" --set data.dir="$W/data" $MODEL \
    --set attention.method=aha --set attention.window=$2 --set attention.lambda=$3 \
    --set train.steps=600 --set train.warmup_steps=20 --set train.lr=2e-3 --set eval.max_batches=0
}
echo "run,window,lambda,val_loss,mu_f,gate_precision,gate_recall,need_fraction" > "$HERE/table.csv"
row() { # name window lambda
  python3 - "$W/$1/eval/eval.json" "$1" "$2" "$3" >> "$HERE/table.csv" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["report"]; g = r["gates"]; n = g["need"]
print(f'{sys.argv[2]},{sys.argv[3]},{sys.argv[4]},{r["loss"]:.4f},{g["mu_f"]:.4f},{n["all_gates"]["precision"] or 0:.4f},{n["all_gates"]["recall"] or 0:.4f},{n["needing"]/n["positions"]:.4f}')
PY
}
for w in 4 8 16 32; do cell "w${w}_l0.01" $w 0.01; row "w${w}_l0.01" $w 0.01; done
for l in 0.003 0.03; do cell "w8_l$l" 8 $l; row "w8_l$l" 8 $l; done
python3 - "$W/base/eval/eval.json" >> "$HERE/table.csv" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["report"]
print(f'base_full,,,{r["loss"]:.4f},1.0000,,,')
PY
cat "$HERE/table.csv"
