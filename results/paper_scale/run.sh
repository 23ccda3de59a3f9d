#!/bin/bash
# The commands behind results/paper_scale (a host of four NVIDIA H200s, bf16; one GPU a lane,
# CUDA_VISIBLE_DEVICES=0..3, the lanes of a group run at once and share the host's CPUs). Each
# bench searches each side's micro-batch (the step's sequences, then halves: --micro-batches 3)
# at fixed tokens a step and keeps the fastest. Its rows were merged into train_bench.csv, whose
# derived columns and figures come from `attnsweep bench train --redraw --out results/paper_scale`.
set -eu
bench() { attnsweep bench train "$@"; }
W="--window 256 --full-usage 0.067 --steps 3 --warmup 2"

# Group 1 (four lanes at once).
bench --out lane0 --model smollm2-135m --lengths 2048,8192 --tokens 32768 --methods full,swa,ppa $W --peers compile
bench --out lane1 --model smollm2-135m --lengths 2048,8192 --tokens 32768 --methods aha,swiattn $W --peers compile
bench --out lane1 --model smollm2-135m --lengths 2048,8192 --tokens 32768 --methods l2a --window 256 --full-usage 0.2 --steps 3 --warmup 2 --peers compile
bench --out lane2 --model qwen2.5-1.5b --lengths 8192 --tokens 16384 --methods full --steps 3 --warmup 2 --peers compile
bench --out lane3 --model olmo2-1b --lengths 4096 --tokens 16384 --methods full,aha $W --peers eager,compile

# Group 2 (four lanes at once; lane 1 ran the attention bench of ../bench/v18 beside them).
W="--window 256 --full-usage 0.067"
bench --out profile_run --profile --model smollm2-135m --lengths 2048 --tokens 32768 --methods full,aha $W \
    --steps 2 --warmup 2 --micro-batches 1 --peers compile    # profiles/: its kernel tables
bench --out lane2 --model qwen2.5-1.5b --lengths 32768 --tokens 32768 --methods full,swa,ppa,aha,swiattn $W --steps 2 --warmup 1 --no-peers
bench --out lane2 --model qwen2.5-1.5b --lengths 32768 --tokens 32768 --methods l2a --window 4095 --full-usage 0.2 --steps 2 --warmup 1 --no-peers
bench --out lane3 --model qwen2.5-1.5b --lengths 131072 --tokens 131072 --methods full --steps 1 --warmup 1 --no-peers
bench --out lane3 --model qwen2.5-1.5b --lengths 131072 --tokens 131072 --methods l2a --window 4095 --full-usage 0.2 --steps 1 --warmup 1 --no-peers
bench --out lane3 --model qwen2.5-1.5b --lengths 131072 --tokens 131072 --methods swa,ppa,aha,swiattn $W --steps 1 --warmup 1 --no-peers

# PPA's mask as one bit test (ppa_mask/, an H100, ec373c2 against its parent 0a1ef9e).
attnsweep bench attention --lengths 16384 --head-dims 128 --windows 256,16384 --sparsities 0.9 \
    --routed-usages 0.1 --ppa-powers 0.5,0.75,0.875 --ppa-window 64 --out ppa_mask

# CUDA graphs on both sides (cuda_graph/; one H200 of a host of two to itself, the binary of
# 8f630da): one method a run, the GPU tests before each; full, aha and swiattn's rows merged
# into train_bench.csv, then `bench train --redraw` on both folders.
for M in full aha swiattn l2a; do
    bench --out cuda_graph_$M --model smollm2-135m --lengths 2048,8192 --tokens 32768 --steps 3 --warmup 2 \
        --micro-batches 2 --methods $M --window 256 --full-usage 0.067 --peers compile --peer-modes default,reduce-overhead
done
