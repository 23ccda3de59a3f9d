#!/bin/bash
# The commands behind results/paper_scale (one H100 80GB HBM3, bf16): each bench merges its
# rows into train_bench.csv (a case measured again replaces its row) and redraws the figures.
# Wall times (this order, one warm machine each group) are in README.md.
set -eu
O=results/paper_scale
bench() { attnsweep bench train --out "$O" "$@"; }

# Qwen2.5-1.5B: L 8192 beside the compiled peer; 32768 and 131072 ours alone.
bench --model qwen2.5-1.5b --lengths 8192 --tokens 16384 --methods full --steps 3 --warmup 2 --peers compile
bench --model qwen2.5-1.5b --lengths 32768 --tokens 32768 --methods full,swa,ppa,aha,swiattn --window 256 --full-usage 0.067 --steps 2 --warmup 1 --no-peers
bench --model qwen2.5-1.5b --lengths 32768 --tokens 32768 --methods l2a --window 4095 --full-usage 0.2 --steps 2 --warmup 1 --no-peers
bench --model qwen2.5-1.5b --lengths 131072 --tokens 131072 --methods full --steps 1 --warmup 1 --no-peers
bench --model qwen2.5-1.5b --lengths 131072 --tokens 131072 --methods l2a --window 4095 --full-usage 0.2 --steps 1 --warmup 1 --no-peers
bench --model qwen2.5-1.5b --lengths 131072 --tokens 131072 --methods swa,ppa,aha,swiattn --window 256 --full-usage 0.067 --steps 1 --warmup 1 --no-peers

# SmolLM2-135M: every method beside the compiled peer.
bench --model smollm2-135m --lengths 2048,8192 --tokens 32768 --methods full,swa,ppa,aha,swiattn --window 256 --full-usage 0.067 --steps 3 --warmup 2 --peers compile
bench --model smollm2-135m --lengths 2048,8192 --tokens 32768 --methods l2a --window 256 --full-usage 0.2 --steps 3 --warmup 2 --peers compile

# OLMo-2-1B beside both peers, and SmolLM2's full attention beside the eager peer (what
# compilation gives the peer).
bench --model olmo2-1b --lengths 4096 --tokens 16384 --methods full,aha --window 256 --full-usage 0.067 --steps 3 --warmup 2 --peers eager,compile
bench --model smollm2-135m --lengths 2048 --tokens 32768 --methods full --steps 3 --warmup 2 --peers eager

# Where a step's GPU time goes (profiles/ holds profile_run/profiles/*.csv): one more step of
# each case, ours and the peer's, under PyTorch's profiler.
attnsweep bench train --out "$O/profile_run" --profile --model olmo2-1b --lengths 4096 --tokens 16384 \
    --methods full,aha --window 256 --full-usage 0.067 --steps 2 --warmup 2 --peers compile
attnsweep bench train --out "$O/profile_run" --profile --model smollm2-135m --lengths 2048 --tokens 32768 \
    --methods full --steps 2 --warmup 2 --peers compile
mkdir -p "$O/profiles" && cp "$O/profile_run/profiles/"kernel_*.csv "$O/profiles/"

# PPA's mask as one bit test (ppa_mask/): the kernels alone. attention_bench.csv is this
# command at ec373c2; run_output.txt also holds it at 0a1ef9e (before the change), run between
# two runs after it on the same machine.
attnsweep bench attention --lengths 16384 --head-dims 128 --windows 256,16384 --sparsities 0.9 \
    --routed-usages 0.1 --ppa-powers 0.5,0.75,0.875 --ppa-window 64 --out "$O/ppa_mask"
