#!/usr/bin/env bash
# Issue 16's GPU checks, each bounded in time and logged to $OUT as it goes: the kernel tests (the invariant GEMM
# against its reference and a row alone against in a batch), the engine's invariance tests on the GPU (tiny
# model), the invariant GEMM against cuBLAS at LLaDA-8B's shapes, then the 8B-dims token check.
#   bash benchmarks/h200_invariant_check.sh     (on the device; then bench step with and without --batch-invariant)
set -u
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, print its last lines
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "## $name (rc $?)"; tail -n 14 "$OUT/$name.txt"
}
step kernel_tests 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_invariant_matmul.py \
    tests/kernels/test_flash_attention.py tests/kernels/test_rms_norm.py
step engine_tests 150 python -m pytest -q -p no:cacheprovider tests/engine/test_batch_invariant.py -k "kernel or refused"
step gemm_rows 60 python benchmarks/gemm_rows.py --invariant --rows 1 16 33 144 1024 4608
step tokens_8b 240 python benchmarks/batch_invariance_gpu.py --methods parallel dual-cache flash-cache flash-verify
