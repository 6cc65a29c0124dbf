#!/usr/bin/env bash
# Issue 55's device runs, each step bounded in time and logged to $OUT:
#   the GPU tests of the MoE kernels (grouped GEMMs, FP8 experts) and of block diffusion through the kernels;
#   `bench generate` on random LLaDA2-mini weights (bf16, then FP8 weights) at batch 1 and 32, `parallel` (LLaDA2.0's
#   sampler) and `edit` (Draft-and-Edit), and on random LLaDA-MoE weights (`parallel`, `flash-cache`); then the
#   weight-read floors of the experts each step touches (benchmarks/moe_floor.py).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
source "$(dirname "$0")/lib.sh"
GPU=$(python -c "import torch; print('H200' if 'H200' in torch.cuda.get_device_name() else 'H100')")
gen() {  # gen NAME SECONDS MODEL [OPTIONS...]
  local name=$1 limit=$2 model=$3; shift 3
  TAIL=6 step "$name" "$limit" python -m flash_dllm.cli bench generate --model "$model" --batch-sizes 1 32 \
      --prompts random --prompt-length 256 --max-tokens 256 "$@"
}
step gpu_tests 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_experts.py \
    tests/decoding/test_block_diffusion.py tests/models/test_moe_models.py
gen llada2_bf16 150 random:llada2-mini --methods parallel edit
gen llada2_fp8 150 random:llada2-mini --methods parallel edit --quantization fp8
gen llada_moe_bf16 120 random:llada-moe --methods parallel flash-cache
TAIL=20 step floors 60 bash -c "python benchmarks/moe_floor.py --gpu $GPU; \
    python benchmarks/moe_floor.py --gpu $GPU --quantization fp8 | tail -2; \
    python benchmarks/moe_floor.py --gpu $GPU --model random:llada-moe | tail -2"
