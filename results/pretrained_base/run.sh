#!/bin/bash
# The commands behind results/pretrained_base (one H200, bf16): the base from
# `make pretrained` (SmolLM2-135M-Instruct, GGUF Q4_1 converted to fp32), the installed torch
# 2.11.0's Python sources as its corpus, then the validation loss and RULER's tasks.
set -eu
B=target/release/attnsweep
BASE=pretrained/smollm2-135m-instruct
make pretrained
$B data prepare --python-package torch --glob '*.py' --tokenizer $BASE/tokenizer.json --out data/torchsrc
TASKS=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe
# 100 prompts a task and length, spread over the default five needle depths (20 each).
$B eval --run $BASE --out results/pretrained_base/probes --tasks $TASKS --set data.dir=data/torchsrc \
    --set eval.lengths=[1024,2048,4096,8192] --set eval.samples=100 \
    --set eval.haystack=text --set eval.chat=true --set eval.batch_size=50 --set eval.seq_len=2048 \
    --set eval.max_batches=25 --set train.dtype=bf16 > results/pretrained_base/probes.log
# The project's corpus (corpora/python.toml, `make corpus`) and the base's loss on every
# validation window of each of its sources.
make corpus
$B eval --run $BASE --out results/pretrained_base/corpus --set data.dir=data/python-smollm2 \
    --set eval.max_batches=0 --set eval.batch_size=16 --set eval.seq_len=2048 --set train.dtype=bf16 \
    > results/pretrained_base/corpus.log
