#!/bin/sh
# Step 5: Qwen2.5-1.5B's shape at L 8,192 on 1 and 2 GPUs (2 runs each,
# alternating), then a grid run with --devices 0,1 --gpus-per-cell 2 beside --devices 0.
# Run from the repository root on a host of two GPUs, with `attnsweep` (the release binary) on
# PATH; W is a scratch folder, OUT where the files this folder keeps are written.
W=${W:-/tmp/multi_gpu}; OUT=${OUT:-$W/out}; mkdir -p $W $OUT
export LD_LIBRARY_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
B=attnsweep; REPO=$PWD; T0=$(date +%s)
$B kernels build 2>&1 | tail -1
echo "kernels $(( $(date +%s) - T0 )) s"
[ -d $W/synq ] || $B data synth --out $W/synq --vocab-size 151936 --train-tokens 2000000 --val-tokens 100000 --max-distance 8192 > /dev/null 2>&1
cd $W
for rep in 1 2; do
  for g in 1 2; do
    rm -rf $W/q_$g
    $B train -q --config $REPO/results/multi_gpu/run/qwen.toml --out $W/q_$g --gpus $g --set train.grad_accum=$g > $OUT/q_g${g}_r$rep.log 2>&1 || tail -5 $OUT/q_g${g}_r$rep.log
    cp $W/q_$g/train_log.csv $OUT/q_g${g}_r$rep.csv
    echo "qwen $g GPU run $rep: $(( $(date +%s) - T0 )) s: $(tail -1 $W/q_$g/train_log.csv)"
  done
done
# A grid whose train cells run data parallel over two GPUs each, beside one GPU each.
sed -e 's/device = "cpu"/device = "cuda"/' $REPO/results/multi_gpu/run/grid_ranks.toml > $W/grid.toml
for mode in "0 1" "0,1 2"; do
  set -- $mode
  $B sweep -q --grid $W/grid.toml --out $W/sw_$2 --devices $1 --gpus-per-cell $2 > $OUT/sweep_$2.log 2>&1 || tail -5 $OUT/sweep_$2.log
  $B plot --sweep $W/sw_$2 > /dev/null 2>&1
  cp $W/sw_$2/summary.csv $OUT/sweep_$2_summary.csv
  echo "sweep --devices $1 --gpus-per-cell $2: $(( $(date +%s) - T0 )) s"
done

