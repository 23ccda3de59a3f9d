#!/usr/bin/env bash
# Full attention against a 16-token window on needle-in-a-haystack probes, both trained from
# scratch on probe documents (byte-level, noise haystack), then evaluated on the whole probe
# suite. Measured on one H100 (about 8 minutes for both trainings side by side); on a CPU the
# same commands run with train.device=cpu, much more slowly.
#   usage: results/niah_probes/run.sh WORKDIR OUT
#   full20k/: STEPS=20000 METHODS=full results/niah_probes/run.sh WORKDIR OUT (then renamed)
set -eu -o pipefail
B=${B:-target/release/attnsweep}
STEPS=${STEPS:-14000} METHODS=${METHODS:-full swa}
W=$1 OUT=$2
$B data probes --out $W/data --tasks niah_single,passkey --lengths 160,208,256 --digits 4 \
    --needles 2 --train-docs 150000 --val-docs 500
C="--set data.dir=$W/data --set data.seq_len=512 --set train.batch_size=16 --set model.hidden_size=256
   --set model.intermediate_size=768 --set model.num_attention_heads=8 --set model.num_key_value_heads=8
   --set train.lr=2e-3 --set train.device=cuda --set attention.window=16 --set train.ckpt_every=2000
   --set train.keep_checkpoints=10 -q"
for m in $METHODS; do
  $B train $C --set train.steps=$STEPS --set train.warmup_steps=200 --set attention.method=$m --out $W/$m &
done
wait
E="--tasks niah_single,niah_multikey,niah_multivalue_short,passkey,mqar,variable_tracking
   --set eval.lengths=[192,256] --set eval.digits=4 --set eval.needles=2 --set eval.samples=20 -q"
for m in $METHODS; do
  $B eval --run $W/$m $E --out $OUT/$m
  mv $OUT/$m/config.toml $OUT/$m/eval_config.toml
  cp $W/$m/train_log.csv $OUT/$m/ && cp $W/$m/config.toml $OUT/$m/train_config.toml
done
# How retrieval appears during training (niah_single at length 256).
for c in $W/full/checkpoints/step_*; do
  $B eval --run $W/full --ckpt $c --tasks niah_single --set eval.lengths=[256] --set eval.digits=4 \
      --set eval.needles=2 --set eval.samples=20 -q --out $W/ck/$(basename $c)
  mkdir -p $OUT/full_checkpoints && cp $W/ck/$(basename $c)/niah.csv $OUT/full_checkpoints/$(basename $c).csv
done
