#!/usr/bin/env bash
# One H200 call for issues 5-6 (written in session 2, to be run next session): the kernel path's tokens on
# the GPU, the method x batch table at LLaDA-8B dimensions, the embedded model with kernels on and off,
# and the flash-verify sweep against parallel and dual-cache. Logs go to $OUT; each part has a time limit
# so one slow part cannot lose the others.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 90 python -m pytest -q tests/kernels tests/models/test_kernel_path.py > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt
timeout 370 python -m flash_dllm.cli bench step --model random:llada-8b --batch-sizes 1 8 16 32 --prompt-length 256 --max-tokens 512 \
    > $OUT/bench_step.txt 2> $OUT/bench_step.err
tail -28 $OUT/bench_step.txt
for kernels in on off; do
    timeout 60 python -m flash_dllm.cli demo --device cuda --dtype float32 --items 100 --kernels $kernels \
        --methods dual-cache flash-cache flash-verify elastic > $OUT/demo_kernels_$kernels.txt 2>/dev/null
    tail -14 $OUT/demo_kernels_$kernels.txt
done
