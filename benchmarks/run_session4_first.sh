#!/usr/bin/env bash
# Session 4's first H200 call (written in session 3): the GPU tests of what session 3 changed after its
# device time ran out (do_not_specialize, the skipped key-mass sweep, the
# 2048-row graph cap, sync-free flash-cache bookkeeping, rotate_and_store, `bench kernels`), then the
# measurements to refresh in RESULTS.md. Each part is time-capped; the sweeps are packed into one file.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 130 python -m pytest -q tests/kernels tests/bench tests/models/test_kernel_path.py tests/engine/test_cuda_graphs.py \
    > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
timeout 60 python -m flash_dllm.cli bench kernels > $OUT/bench_kernels.txt 2>&1
tail -16 $OUT/bench_kernels.txt
timeout 250 python -m flash_dllm.cli bench step --batch-sizes 1 8 16 32 > $OUT/bench_step.txt 2> $OUT/bench_step.err
tail -26 $OUT/bench_step.txt
timeout 80 python -m flash_dllm.cli sweep --task arith --device cuda --dtype float32 --no-progress --limit 200 \
    --methods parallel dual-cache flash-verify --threshold 0.5 0.7 0.9 --tracking-budget 16 80 \
    --verify-threshold 0.5 0.8 --out-dir $OUT/sweep > $OUT/sweep.log 2>&1
tail -20 $OUT/sweep/sweep.md
cd $OUT && tar czf sweep.tgz sweep sweep.log && rm -rf sweep sweep.log
