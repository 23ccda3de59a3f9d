#!/bin/sh
# Every GPU test (`--ignored`: the kernels against the reference path, the oracle's gates on the
# GPU against the CPU's, the memory plan's prediction, the fused optimizer) on a GPU machine,
# from the release binary and the library's test binary built beside it
# (`cargo test --release --lib --no-run`), both carried there.
set -e
export LD_LIBRARY_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
attnsweep kernels build
"$UNIT" --ignored --test-threads 1 | tee results/gpu_tests/gpu_tests.txt
