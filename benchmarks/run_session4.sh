#!/usr/bin/env bash
# Session 4's second H200 call: verify passes padded to row buckets (so that CUDA graphs replay them) and the
# kernel warm-up at cache allocation (engine/warmup.py); where a batch-1 step's GPU time goes.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 120 python -m pytest -q tests/engine tests/models/test_kernel_path.py tests/kernels/test_flash_attention.py \
    > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt
timeout 120 python -m flash_dllm.cli bench step --batch-sizes 1 8 32 --methods flash-cache flash-verify \
    > $OUT/bench_step.txt 2> $OUT/bench_step.err
tail -7 $OUT/bench_step.txt
timeout 90 python benchmarks/profile_step.py --cases flash-cache:1 flash-verify:1 > $OUT/profile.txt 2>&1
tail -4 $OUT/profile.txt
timeout 100 python -m flash_dllm.cli sweep --task arith --device cuda --dtype float32 --no-progress --limit 200 \
    --methods parallel dual-cache flash-verify --threshold 0.5 0.7 0.9 --tracking-budget 16 80 \
    --verify-threshold 0.5 0.8 --out-dir $OUT/sweep > $OUT/sweep.log 2>&1
tail -20 $OUT/sweep/sweep.md
cd $OUT && tar czf sweep.tgz sweep sweep.log && rm -rf sweep sweep.log
