#!/bin/sh
# Step 1: binaries, the CUDA kernel library (with c10d's NCCL group), every GPU test, a
# two-GPU smoke run.
# Run from the repository root on a host of two GPUs, with `attnsweep` (the release binary) on
# PATH; W is a scratch folder, OUT where the files this folder keeps are written.
W=${W:-/tmp/multi_gpu}; OUT=${OUT:-$W/out}; mkdir -p $W $OUT
export LD_LIBRARY_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
env | grep -E "NCCL|MULTICAST|NVLS|NVSHMEM" | sort
T0=$(date +%s)
attnsweep kernels build 2>&1 | tail -4
echo "kernel build $(( $(date +%s) - T0 )) s"
[ -d $W/syn ] || attnsweep data synth --out $W/syn --vocab-size 49152 --train-tokens 8000000 --val-tokens 200000 --max-distance 2048 2>&1 | tail -1
echo "data $(( $(date +%s) - T0 )) s"
cd $W && rm -rf $W/smoke && attnsweep train --config $OLDPWD/results/multi_gpu/run/smol.toml --out $W/smoke --gpus 2 --set train.grad_accum=2 --set train.steps=6 2>&1 | tail -6; cd $OLDPWD
cat $W/smoke/train_log.csv 2>/dev/null
cp $W/smoke/train_log.csv $OUT/smoke_log.csv 2>/dev/null
echo "smoke $(( $(date +%s) - T0 )) s"
"${UNIT:?the unit-test binary (cargo test --release --lib --no-run)}" --ignored --test-threads 1 2>&1 | tee $OUT/gpu_tests.txt | grep -v "^test .* ok$" | tail -12
echo "tests $(( $(date +%s) - T0 )) s"
