#!/usr/bin/env bash
# Issue 17's GPU sequence (session 10), each step bounded in time and logged to $OUT as it goes: the routed
# kernels' tests, the routing's engine tests (kernel path = reference), then `bench step` routed against dense at
# LLaDA-8B dims with the context extended (batch 8 up to 16k: a 32k batch-8 cache does not fit), then passkey
# retrieval through the kernel path. Run on the device: bash benchmarks/h200_routing_check.sh [LENGTHS...]
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/long
python -c "
import json; from flash_dllm.config import PRESETS
json.dump({**PRESETS['llada-8b'], 'max_sequence_length': 40960}, open('/tmp/long/config.json', 'w'))"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, print its last lines
  local name=$1 limit=$2 rc; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; rc=$?; echo "## $name (rc $rc)"; tail -n 8 "$OUT/$name.txt"
  return $rc
}
kernel_tests=(tests/kernels/test_chunk_summaries.py tests/kernels/test_flash_attention.py)
[ -f tests/kernels/test_chunk_scores.py ] && kernel_tests+=(tests/kernels/test_chunk_scores.py)
# a kernel that does not compile on the GPU makes every benchmark below fail: stop here instead
step kernel_tests 120 python -m pytest -q -x -p no:cacheprovider "${kernel_tests[@]}" -k "routed or tile or chunk" || exit 1
step routing_tests 90 python -m pytest -q -x -p no:cacheprovider tests/cache/test_routing.py || exit 1
lengths=("$@"); [ ${#lengths[@]} -eq 0 ] && lengths=(8192 32768)
for length in "${lengths[@]}"; do
  batches="1 8"; [ "$length" -gt 16384 ] && batches=1
  step "step_$length" 120 python -m flash_dllm.cli bench step --model random:/tmp/long --methods dual-cache \
      flash-cache --batch-sizes $batches --prompt-length "$length" --max-tokens 64 --warmup 8 --iters 32 \
      --kv-routing dense chunk --kv-budget 0.125
done
step retrieval 120 python benchmarks/routing_retrieval.py --device cuda --lengths 8000 --items 50
