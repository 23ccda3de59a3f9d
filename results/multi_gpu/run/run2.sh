#!/bin/sh
# Step 2: training throughput on 1 and 2 GPUs, ours (3 runs each, alternating) and the DDP peer
# (torchrun, compiled blocks, 16 x 2,048 tokens a rank a step).
# Run from the repository root on a host of two GPUs, with `attnsweep` (the release binary) on
# PATH; W is a scratch folder, OUT where the files this folder keeps are written.
W=${W:-/tmp/multi_gpu}; OUT=${OUT:-$W/out}; mkdir -p $W $OUT
export LD_LIBRARY_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
B=attnsweep; REPO=$PWD; C=$REPO/results/multi_gpu/run/smol.toml
T0=$(date +%s)
cd $W
for rep in 1 2 3; do
  for g in 1 2; do
    rm -rf $W/tp_$g
    $B train -q --config $C --out $W/tp_$g --gpus $g --set train.grad_accum=$g --set train.steps=25 > $OUT/tp_g${g}_r$rep.log 2>&1 || { tail -20 $OUT/tp_g${g}_r$rep.log; exit 1; }
    cp $W/tp_$g/train_log.csv $OUT/tp_g${g}_r$rep.csv
    echo "ours $g GPU run $rep: $(( $(date +%s) - T0 )) s, last row $(tail -1 $W/tp_$g/train_log.csv)"
  done
done
for g in 1 2; do
  torchrun --standalone --nproc_per_node=$g $REPO/kernels/train_peer.py --impls compile --methods full \
    --lengths 2048 --tokens 32768 --model $REPO/results/multi_gpu/run/smol_model.json --steps 10 --warmup 5 \
    > $OUT/peer_g$g.csv 2> $OUT/peer_g$g.err
  echo "peer $g GPU: $(( $(date +%s) - T0 )) s: $(cat $OUT/peer_g$g.csv)"
done
