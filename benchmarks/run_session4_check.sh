#!/usr/bin/env bash
# Session 4's fourth H200 call: GPU tests of the verify tiles, the sync-free verify bookkeeping and the padded
# verify graphs; where a batch-1 step's time goes with CUDA graphs on; flash-verify / flash-cache steps.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q tests/kernels/test_flash_attention.py tests/engine tests/models/test_kernel_path.py \
    tests/decoding/test_flash_verify.py > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt
timeout 120 python benchmarks/profile_step.py --cuda-graphs on --cases flash-cache:1 dual-cache:1 flash-verify:1 \
    > $OUT/profile_graphs.txt 2>&1
tail -5 $OUT/profile_graphs.txt
timeout 120 python -m flash_dllm.cli bench step --batch-sizes 1 8 32 --methods flash-verify \
    > $OUT/bench_step.txt 2> $OUT/bench_step.err
tail -4 $OUT/bench_step.txt
