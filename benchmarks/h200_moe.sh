#!/usr/bin/env bash
# Issue 55's device runs, each step bounded in time and logged to $OUT:
#   the GPU tests of the MoE kernels (grouped GEMMs, FP8 experts) and of block diffusion through the kernels and CUDA
#   graphs; the tiny LLaDA2 model's training (training/train_llada2.py, to $OUT/llada2/model) and its evaluation
#   (benchmarks/block_diffusion_eval.py: parallel, edit and flash-cache at three settings);
#   `bench generate` on random LLaDA2-mini weights (bf16, then FP8 weights) at batch 1 and 32, `parallel` (LLaDA2.0's
#   sampler) and `edit` (Draft-and-Edit), and on LLaDA-MoE weights (bidirectional: `parallel`, `flash-cache`); the
#   weight-read floors of the experts each step touches
#   (benchmarks/moe_floor.py); `bench kernels` on LLaDA2-mini: the router and experts against their references and
#   the touched experts' read floor at 32-4,096 rows, and the GQA-packed attention beside a program per query head.
#   PART=check (tests, benches), train (training, evaluation), pack (the GPU tests in full, and the GQA-packed
#   attention against a program per query head at batch 1-32 on LLaDA2-mini and Dream-7B: kernels/flash_attention's
#   `packs`) or all (check and train, the default); MINUTES: the training's budget (default 4); FP8=0 skips the FP8
#   rows; INIT: a checkpoint the training starts from (a resumed run).
#   PART=serve (issue 56): `serve` on random LLaDA2-mini weights (parallel, 128 tokens, batches up to 64; SERVE_ARGS
#   adds flags, e.g. "--quantization fp8"), then `bench serve` with 1, 16 and 64 clients (CLIENTS), 256-token random
#   prompts, 40 s each (DURATION); the server's wheels (the GPU image has no FastAPI/uvicorn) from WHEELS=.whl.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
source "$(dirname "$0")/lib.sh"
GPU=$(python -c "import torch; print('H200' if 'H200' in torch.cuda.get_device_name() else 'H100')")
GPU_TESTS="tests/kernels/test_moe_experts.py tests/kernels/test_moe_router.py tests/kernels/test_flash_attention.py
    tests/decoding/test_block_diffusion.py"
gen() {  # gen NAME SECONDS MODEL [OPTIONS...]
  local name=$1 limit=$2 model=$3; shift 3
  TAIL=6 step "$name" "$limit" python -m flash_dllm.cli bench generate --model "$model" --batch-sizes 1 32 \
      --prompts random --prompt-length 256 --max-tokens 128 "$@"
}
case "${PART:-all}" in
check|all)
  step gpu_tests 90 python -m pytest -q -p no:cacheprovider $GPU_TESTS
  TAIL=30 step kernels 90 python -m flash_dllm.cli bench kernels --model random:llada2-mini --batch-sizes 1 32 \
      --rows 32 --kv-length 1024 --gemm-rows 32 144 1024 4096
  [ "${FP8:-1}" = 1 ] && TAIL=8 step kernels_fp8 90 bash -c "python -m flash_dllm.cli bench kernels \
      --model random:llada2-mini --quantization fp8 --batch-sizes 1 --rows 32 --gemm-rows 32 144 1024 4096 | head -8"
  gen llada2_bf16 80 random:llada2-mini --methods parallel edit
  [ "${FP8:-1}" = 1 ] && gen llada2_fp8 70 random:llada2-mini --methods parallel edit --quantization fp8
  gen llada_moe_bf16 70 random:llada-moe --methods parallel flash-cache
  [ "${FP8:-1}" = 1 ] && gen llada_moe_fp8 70 random:llada-moe --methods parallel flash-cache --quantization fp8
  TAIL=20 step floors 15 bash -c "python benchmarks/moe_floor.py --gpu $GPU; \
      python benchmarks/moe_floor.py --gpu $GPU --quantization fp8 | tail -2" ;;&
pack)  # the GQA-packed attention against a program per query head, by batch (LLaDA2-mini 16/4, Dream-7B 28/4)
  step gpu_tests 240 python -m pytest -q -x -p no:cacheprovider $GPU_TESTS
  for model in llada2-mini dream-7b; do
    FILTER="grep -E 'attention|kernel '" TAIL=20 step "pack_$model" 120 python -m flash_dllm.cli bench kernels \
        --model "random:$model" --batch-sizes 1 4 8 16 32 --rows 32 --kv-length 1024 --gemm-rows 32
  done ;;
serve)
  python -m flash_dllm.cli serve --model random:llada2-mini --method parallel --max-tokens 128 --max-batch 64 \
      --port 8123 ${SERVE_ARGS:-} > "$OUT/server.txt" 2>&1 &
  pid=$!
  if wait_ready $pid "$OUT/server.txt" 300; then
    echo "## server ready after ${READY_S} s"
    for clients in ${CLIENTS:-1 16 64}; do
      TAIL=4 step "serve_$clients" $((${DURATION:-40} + 90)) python -m flash_dllm.cli bench serve \
          --url http://127.0.0.1:8123 --clients "$clients" --duration "${DURATION:-40}" --prompts random \
          --num-prompts 64 --prompt-length 256
    done
  fi
  kill -INT $pid 2> /dev/null; wait $pid 2> /dev/null ;;
train|all)
  TAIL=8 step train $((${MINUTES:-4} * 60 + 60)) python training/train_llada2.py --out "$OUT/llada2/model" \
      --minutes "${MINUTES:-4}" --edit-noise 0.1 --eval 0 ${INIT:+--init "$INIT"}
  TAIL=12 step evals 150 python benchmarks/block_diffusion_eval.py --model "$OUT/llada2/model" --items 100 ;;
esac
