#!/usr/bin/env bash
# Session 3's H200 call (issues 5-6), one call, each part time-capped: GPU tests of every kernel and of the CUDA
# graphs; the kernel micro-benchmarks; `bench step` for the methods whose cached passes changed this session
# (reference and elastic do not go through them); graphs off at batch 1 for comparison; the embedded tasks
# for every method through `flash-dllm sweep` (kernels on), dual/flash/verify with kernels off (same tokens?),
# and the flash-verify (beta_t, gamma) grid against parallel and dual-cache.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python -m pytest -q tests/kernels tests/models/test_kernel_path.py tests/engine/test_cuda_graphs.py \
    > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
graphs=on; grep -q "FAILED tests/engine\|FAILED tests/models" $OUT/gpu_tests.txt && graphs=off
timeout 40 python -m flash_dllm.cli bench kernels > $OUT/kernel_check.txt 2>&1
cat $OUT/kernel_check.txt
timeout 170 python -m flash_dllm.cli bench step --cuda-graphs $graphs --batch-sizes 1 8 16 32 \
    --methods prefix-cache dual-cache flash-cache flash-verify > $OUT/bench_step.txt 2> $OUT/bench_step.err
tail -17 $OUT/bench_step.txt
timeout 30 python -m flash_dllm.cli bench step --cuda-graphs off --batch-sizes 1 --methods dual-cache flash-cache \
    flash-verify > $OUT/bench_step_nographs.txt 2>&1
tail -4 $OUT/bench_step_nographs.txt
sweep="python -m flash_dllm.cli sweep --device cuda --dtype float32 --no-progress"
for task in arith trace passkey; do
    timeout 40 $sweep --task $task --limit 100 --cuda-graphs $graphs --out-dir $OUT/methods_$task \
        --methods reference parallel prefix-cache dual-cache flash-cache flash-verify elastic lossless \
        > $OUT/methods_$task.log 2>&1
    tail -9 $OUT/methods_$task/sweep.md
done
timeout 25 $sweep --task arith --limit 100 --kernels off --methods dual-cache flash-cache flash-verify \
    --out-dir $OUT/kernels_off > $OUT/kernels_off.log 2>&1
tail -4 $OUT/kernels_off/sweep.md
timeout 80 $sweep --task arith --limit 200 --cuda-graphs $graphs --methods parallel dual-cache flash-verify \
    --threshold 0.5 0.7 0.9 --tracking-budget 16 80 --verify-threshold 0.5 0.8 --out-dir $OUT/sweep > $OUT/sweep.log 2>&1
tail -20 $OUT/sweep/sweep.md
# $OUT brings back at most 8 files: pack the sweeps' directories and logs.
cd $OUT && tar czf sweeps.tgz methods_* kernels_off sweep *.log && rm -rf methods_* kernels_off sweep *.log
