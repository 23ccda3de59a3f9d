#!/bin/bash
# L2A's start on the pretrained base, on the CPU: 8 steps of one 512-token sequence at window
# 64 with the grid's L2A recipe (sweeps/gpu/l2a_pretrained.toml: RoPE base 500,000, the l2a
# stage's settings), in fp32, from `make pretrained` and `make corpus`; beside it the same L2A
# with the inert start and full attention, on the same batches. Writes train_log_l2a.csv,
# train_log_l2a_inert.csv and train_log_full.csv here: their first rows are the loss before
# any update (L2A with every gate open: each layer adds its window output and a copy of full
# attention; with the inert start, its window alone). About 3 minutes on 2 cores; the runs'
# weights go to a scratch directory.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
P=pretrained/smollm2-135m-instruct
common=(--set data.dir=data/python-smollm2 --set data.seq_len=512 --set model.rope_theta=500000
    --set train.lr=5e-5 --set train.warmup_steps=3 --set train.min_lr_ratio=0
    --set train.beta2=0.95 --set train.weight_decay=0
    --set train.steps=8 --set train.batch_size=1 --set train.log_every=1
    --set train.ckpt_every=100 --set train.device=cpu --set train.dtype=fp32
    --set eval.max_batches=1)
attnsweep train -q -c $P/config.toml --init-from $P --out "$run/l2a" "${common[@]}" \
    --set attention.method=l2a --set attention.window=64 --set attention.tau=0.5 \
    --set attention.lambda=1.31e-3 --set attention.p_force=0.1 \
    --set train.lambda_ramp=true --set train.router_lr_mult=620 --set train.freeze_mlp=true
# The same L2A with its global module's output projection at zero (the inert start).
attnsweep train -q -c $P/config.toml --init-from $P --out "$run/l2a_inert" "${common[@]}" \
    --set attention.method=l2a --set attention.window=64 --set attention.tau=0.5 \
    --set attention.lambda=1.31e-3 --set attention.p_force=0.1 --set attention.l2a_start=inert \
    --set train.lambda_ramp=true --set train.router_lr_mult=620 --set train.freeze_mlp=true
attnsweep train -q -c $P/config.toml --init-from $P --out "$run/full" "${common[@]}" \
    --set attention.method=full
cp "$run/l2a/train_log.csv" "$here/train_log_l2a.csv"
cp "$run/l2a_inert/train_log.csv" "$here/train_log_l2a_inert.csv"
cp "$run/full/train_log.csv" "$here/train_log_full.csv"
