#!/usr/bin/env bash
# Session 4's last H200 call: the GPU tests of everything changed this session (sync counts per step
# included), then the full bench step and bench kernels for RESULTS.md.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 130 python -m pytest -q tests/engine tests/kernels tests/models/test_kernel_path.py \
    tests/decoding/test_flash_verify.py tests/bench > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
timeout 270 python -m flash_dllm.cli bench step --batch-sizes 1 8 16 32 > $OUT/bench_step.txt 2> $OUT/bench_step.err
tail -26 $OUT/bench_step.txt
timeout 50 python -m flash_dllm.cli bench kernels > $OUT/bench_kernels.txt 2>&1
tail -16 $OUT/bench_kernels.txt
