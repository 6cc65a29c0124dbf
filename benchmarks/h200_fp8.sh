#!/usr/bin/env bash
# Issue 38's device runs, each step bounded in time and logged to $OUT (PART picks which):
#   PART=check  the GPU tests of the FP8 kernels and the kernel path; `bench kernels --quantization fp8` (the kernels
#               around the FP8 GEMMs, and each GEMM against cuBLAS bf16 and its weight-read floor); `bench generate`
#               at batch 1, bf16 then fp8; the logits gate (benchmarks/fp8_accuracy.py logits)
#   PART=b32    `bench generate` at batch 32, bf16 then fp8; the embedded tasks' accuracy gate
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, print its last lines
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "## $name (rc $?)"; tail -n "${TAIL:-4}" "$OUT/$name.txt"
}
gen() {  # gen NAME SECONDS BATCH METHODS... [-- OPTIONS...]
  local name=$1 limit=$2 batch=$3; shift 3
  TAIL=${TAIL:-8} step "$name" "$limit" python -m flash_dllm.cli bench generate --batch-sizes "$batch" --methods "$@"
}
if [ "${PART:-check}" = check ]; then
  step gpu_tests 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8.py tests/kernels/test_rms_norm.py \
      tests/kernels/test_silu_mul.py tests/models/test_kernel_path.py
  TAIL=40 step kernels 120 python -m flash_dllm.cli bench kernels --quantization fp8 --batch-sizes 1 32 --rows 144
  TAIL=8 gen gen_b1_bf16 100 1 dual-cache flash-cache flash-verify
  TAIL=8 gen gen_b1_fp8 100 1 dual-cache flash-cache flash-verify --quantization fp8
  TAIL=8 step logits 200 python benchmarks/fp8_accuracy.py logits
else
  TAIL=8 gen gen_b32_bf16 260 32 dual-cache flash-cache flash-verify
  TAIL=8 gen gen_b32_fp8 200 32 dual-cache flash-cache flash-verify --quantization fp8
fi
