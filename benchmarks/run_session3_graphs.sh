#!/usr/bin/env bash
# Session 3's second H200 call, after run_session3.sh showed CUDA-graph captures of varying shapes slowing
# flash-verify down: graphs now capture a shape only after 3 sightings, without gc/empty_cache, and the eval
# harness warms up on a full batch. Re-measures what that changes.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 60 python -m pytest -q tests/engine/test_cuda_graphs.py tests/models/test_kernel_path.py > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt
timeout 80 python -m flash_dllm.cli bench step --batch-sizes 1 32 --methods dual-cache flash-cache flash-verify \
    > $OUT/bench_step.txt 2> $OUT/bench_step.err
tail -7 $OUT/bench_step.txt
sweep="python -m flash_dllm.cli sweep --device cuda --dtype float32 --no-progress"
timeout 80 $sweep --task arith --limit 200 --methods parallel dual-cache flash-verify --threshold 0.5 0.7 0.9 \
    --tracking-budget 16 80 --verify-threshold 0.5 0.8 --out-dir $OUT/sweep > $OUT/sweep.log 2>&1
tail -20 $OUT/sweep/sweep.md
timeout 60 $sweep --task arith --limit 100 --out-dir $OUT/methods_arith \
    --methods reference parallel prefix-cache dual-cache flash-cache flash-verify elastic lossless > $OUT/methods_arith.log 2>&1
tail -9 $OUT/methods_arith/sweep.md
cd $OUT && tar czf sweeps.tgz methods_* sweep *.log && rm -rf methods_* sweep *.log
