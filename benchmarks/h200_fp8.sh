#!/usr/bin/env bash
# Issue 38's device runs, each step bounded in time and logged to $OUT (PART picks which):
#   PART=check  the GPU tests of the FP8 kernels (activations, KV cache) and of the kernel path and the warm-up;
#               `bench kernels --quantization fp8` (the kernels around the FP8 GEMMs, and each GEMM against cuBLAS bf16
#               and its weight-read floor, CUDA-graph timed); `bench generate` at batch 1: bf16, fp8 weights, both
#   PART=b32    `bench generate` at batch 32: bf16, fp8 weights, both
#   PART=long   `bench step` Flash-Cache batch 1 at 32k prompt tokens (LLaDA-8B, context extended), dense and
#               chunk-routed at 1/8: bf16 cache, then fp8 cache
#   PART=gates  the accuracy gates (benchmarks/fp8_accuracy.py: the embedded tasks, the logits)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
source "$(dirname "$0")/lib.sh"
gen() {  # gen NAME SECONDS BATCH [OPTIONS...]: the three methods of the speed targets
  local name=$1 limit=$2 batch=$3; shift 3
  TAIL=5 step "$name" "$limit" python -m flash_dllm.cli bench generate --batch-sizes "$batch" \
      --methods dual-cache flash-cache flash-verify "$@"
}
case "${PART:-check}" in
check)
  step gpu_tests 250 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8.py tests/kernels/test_kv_fp8.py \
      tests/kernels/test_rope_cache_write.py tests/kernels/test_fused_qkv_rope.py tests/kernels/test_flash_attention.py \
      tests/kernels/test_chunk_summaries.py tests/kernels/test_drift_cosine.py tests/models/test_kernel_path.py \
      tests/engine/test_warmup.py
  TAIL=30 step kernels 100 python -m flash_dllm.cli bench kernels --quantization fp8 --batch-sizes 1 32 --rows 144
  gen b1_bf16 60 1
  gen b1_fp8 60 1 --quantization fp8
  gen b1_both 60 1 --quantization fp8 --kv-cache-dtype fp8 ;;
b32)
  gen b32_bf16 230 32
  gen b32_fp8 160 32 --quantization fp8
  gen b32_both 160 32 --quantization fp8 --kv-cache-dtype fp8 ;;
long)
  mkdir -p /tmp/long
  python -c "import json; from flash_dllm.config import PRESETS
json.dump({**PRESETS['llada-8b'], 'max_sequence_length': 40960}, open('/tmp/long/config.json', 'w'))"
  for kv in bf16 fp8; do
    TAIL=6 step "long_$kv" 170 python -m flash_dllm.cli bench step --model random:/tmp/long --methods flash-cache \
        --batch-sizes 1 --prompt-length 32768 --max-tokens 64 --warmup 8 --iters 32 --kv-routing dense chunk \
        --kv-budget 0.125 $([ $kv = fp8 ] && echo --kv-cache-dtype fp8)
  done ;;
gates)
  TAIL=70 step tasks 330 python benchmarks/fp8_accuracy.py tasks --items 200
  TAIL=12 step logits 100 python benchmarks/fp8_accuracy.py logits ;;
esac
pack_out h200_fp8
