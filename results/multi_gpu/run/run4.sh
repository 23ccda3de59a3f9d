#!/bin/sh
# Step 4: the link between the GPUs, throughput (ours 3 runs on 1 and 2 GPUs, alternating) and
# the loss curves at one global batch.
# Run from the repository root on a host of two GPUs, with `attnsweep` (the release binary) on
# PATH; W is a scratch folder, OUT where the files this folder keeps are written.
W=${W:-/tmp/multi_gpu}; OUT=${OUT:-$W/out}; mkdir -p $W $OUT
export LD_LIBRARY_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
B=attnsweep; REPO=$PWD; C=$REPO/results/multi_gpu/run/smol.toml; T0=$(date +%s)
nvidia-smi topo -m > $OUT/topology.txt 2>&1
cat > $W/bw.py <<'PY'
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl"); r = dist.get_rank(); torch.cuda.set_device(r)
x = torch.ones(256 << 20, device="cuda")  # 1 GiB of fp32
for _ in range(3): dist.all_reduce(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): dist.all_reduce(x)
torch.cuda.synchronize(); s = (time.perf_counter() - t) / 10
n = dist.get_world_size()
if r == 0: print(f"all_reduce 1 GiB fp32 over {n} GPUs: {s*1e3:.1f} ms, bus bandwidth {(1<<30) * 2 * (n-1) / n / s / 1e9:.1f} GB/s")
PY
torchrun --standalone --nproc_per_node=2 $W/bw.py > $OUT/allreduce.txt 2>&1; cat $OUT/allreduce.txt | tail -1
cd $W
for rep in 1 2 3; do
  for g in 1 2; do
    rm -rf $W/tp_$g
    $B train -q --config $C --out $W/tp_$g --gpus $g --set train.grad_accum=$g --set train.steps=25 > $OUT/tp_g${g}_r$rep.log 2>&1 || tail -5 $OUT/tp_g${g}_r$rep.log
    cp $W/tp_$g/train_log.csv $OUT/tp_g${g}_r$rep.csv
  done
done
echo "throughput $(( $(date +%s) - T0 )) s"
S="--set train.grad_accum=2 --set train.steps=120 --set train.warmup_steps=20"
for run in "1 1" "1 2" "2 1"; do
  set -- $run
  rm -rf $W/lc
  $B train -q --config $C --out $W/lc --gpus $1 $S --set train.seed=$2 > $OUT/lc_g$1_s$2.log 2>&1 || tail -5 $OUT/lc_g$1_s$2.log
  cp $W/lc/train_log.csv $OUT/lc_g$1_s$2.csv
  cp $W/lc/val_log.csv $OUT/lc_g$1_s$2_val.csv
  echo "curve $1 GPU seed $2: $(( $(date +%s) - T0 )) s: $(tail -1 $W/lc/train_log.csv)"
done

