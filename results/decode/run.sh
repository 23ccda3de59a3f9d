#!/bin/sh
# Greedy decoding of SmolLM2-135M's shape per method, context and batch, beside transformers'
# static-cache path, on one GPU (the binary and the kernel library built there first).
set -e
B="attnsweep bench decode --batches 1,8 --short 16 --new 64 --reps 3 --out results/decode"
# Full attention with the transformers peer (compiles once per context and batch).
$B --methods full --contexts 1024,4096,16384
# Every method with graphs, and full attention also without them.
$B --no-peers --methods full --contexts 1024,4096,16384 --eager
$B --no-peers --methods swa,sinks,ppa,aha,l2a,swiattn --contexts 1024,4096,16384
# Where a step's GPU time goes: one more run of full attention and AHA at 4K, batch 1.
attnsweep bench decode --contexts 4096 --batches 1 --short 16 --new 64 --reps 3 --no-peers \
  --profile --methods full,aha --out /tmp/decode_profile
mkdir -p results/decode/profiles
cp /tmp/decode_profile/profiles/kernel_kinds.csv /tmp/decode_profile/profiles/kernel_time.csv results/decode/profiles/
# L2A's prefill at 32K against full attention's (the time to first token, batch 1), the
# routers calibrated to the trained models' 1.1 % open (results/l2a_pretrained).
attnsweep bench decode --contexts 32768 --batches 1 --short 16 --new 16 --reps 3 --no-peers \
  --methods full,l2a --full-usage 0.011 --out results/decode/prefill_32k
# Where the 32K prefill's GPU time goes: one profiled run of each.
attnsweep bench decode --contexts 32768 --batches 1 --short 2 --new 1 --reps 1 --no-peers --profile \
  --methods full,l2a --full-usage 0.011 --out /tmp/prefill_profile
cp /tmp/prefill_profile/profiles/kernel_kinds.csv /tmp/prefill_profile/profiles/kernel_time.csv results/decode/prefill_32k/
