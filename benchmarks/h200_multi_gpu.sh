#!/usr/bin/env bash
# Issue 39's GPU runs, for a machine of 2 or 4 H200s (nvidia-h200-x2 / -x4; ask the device tool's status first),
# each step bounded in time and logged to $OUT (PART picks which):
#   PART=tp     the tensor-parallel tests on the GPUs, then `bench generate` (random LLaDA-8B, bf16, prompt 256 + 512,
#               one token per iteration, through LLM.generate) at TP = 1, 2 (and 4 with 4 GPUs), batch 1 and 32:
#               dual-cache and flash-cache, with the collectives' ms/iter (goal: flash-cache TP=2 <= 0.6x TP=1,
#               dual-cache <= 0.65x, batch 1)
#   PART=dp     `bench serve` against `serve --data-parallel-size 1`, then 2 (goal: >= 1.9x the throughput)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
source "$(dirname "$0")/lib.sh"
TAIL=${TAIL:-6}
case "${PART:-tp}" in
tp)
  step tp_tests 200 python -m pytest -q -p no:cacheprovider tests/engine/test_tensor_parallel.py
  sizes="1 2"; [ "$GPUS" -ge 4 ] && sizes="1 2 4"
  for tp in $sizes; do
    for batch in 1 32; do
      step "tp${tp}_b$batch" 200 python -m flash_dllm.cli bench generate --batch-sizes "$batch" \
          --methods dual-cache flash-cache --tensor-parallel-size "$tp"
    done
  done ;;
dp)
  for dp in 1 2; do
    python -m flash_dllm.cli serve --port 8123 --model random:llada-8b --method flash-cache --max-tokens 256 \
        --block-length 32 --max-batch 32 --data-parallel-size "$dp" > "$OUT/server_dp$dp.txt" 2>&1 &
    pid=$!
    wait_ready $pid "$OUT/server_dp$dp.txt" 300 && echo "dp $dp: ready after ${READY_S} s"
    step "serve_dp$dp" 200 python -m flash_dllm.cli bench serve --url http://127.0.0.1:8123 --clients $((64 * dp)) \
        --duration 60 --prompts random --num-prompts 64
    kill -INT $pid; wait $pid
  done ;;
esac
pack_out h200_multi_gpu
