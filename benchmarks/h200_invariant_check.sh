#!/usr/bin/env bash
# Issue 16's GPU checks, each bounded in time and logged to $OUT as it goes: the kernel tests (the invariant GEMM
# against its reference, every tiling the same bits, a row alone against in a batch), the engine's invariance
# tests on the GPU (tiny model), the GEMM's tilings against cuBLAS at LLaDA-8B's shapes (add --write to store
# the best), the cost (bench step with and without --batch-invariant), the 8B-dims token check and the embedded
# tasks at batch 1, 8 and 32.
#   bash benchmarks/h200_invariant_check.sh     (on the device; PYTHONPATH is set here)
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/lib.sh"
TAIL=${TAIL:-14}
no_index_kernel() { grep -v IndexKernel; }  # the logs without their IndexKernel lines
FILTER=no_index_kernel
step kernel_tests 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_invariant_matmul.py \
    tests/kernels/test_flash_attention.py tests/kernels/test_rms_norm.py
step engine_tests 100 python -m pytest -q -p no:cacheprovider tests/engine/test_batch_invariant.py -k "kernel or refused"
step tilings 150 python benchmarks/invariant_matmul_configs.py
for mode in "" --batch-invariant; do
  step "bench_step${mode}" 90 python -m flash_dllm.cli bench step --model random:llada-8b --batch-sizes 1 32 \
      --methods dual-cache flash-cache flash-verify $mode
done
step tokens_8b 240 python benchmarks/batch_invariance_gpu.py --methods parallel dual-cache flash-cache flash-verify
step tasks 120 python benchmarks/batch_invariance_tasks.py --device cuda --items 20
pack_out h200_invariant_check
