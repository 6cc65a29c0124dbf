#!/usr/bin/env bash
# Issue 17's GPU sequence, each step bounded in time and logged to $OUT as it goes: the routing kernels' tests,
# the routing's engine tests (kernel path = reference), then `bench step` routed against dense at LLaDA-8B dims
# with the context extended (batch 8 up to 16k: a 32k batch-8 cache does not fit), optionally the routed rows of
# another tree too (BASE=<a `git archive` of it>: the same run, one after the other), then the profile of a routed
# dual-cache step at 8k (PROFILE=0: not). More policies benched: POLICIES="kmeans ..."; more profiled cases:
# PROFILE_CASES="flash-cache:1:kmeans ...". Run on the device:
# [BASE=dir [BASE_LENGTHS="L..."]] [PART=tests|bench|all] bash benchmarks/h200_routing_check.sh [LENGTHS...]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/long
PART=${PART:-all}
PYTHONPATH=$PWD/src python -c "
import json; from flash_dllm.config import PRESETS
json.dump({**PRESETS['llada-8b'], 'max_sequence_length': 40960}, open('/tmp/long/config.json', 'w'))"
source "$(dirname "$0")/lib.sh"
TAIL=${TAIL:-12}
if [ "$PART" != bench ]; then
  # a kernel that does not compile on the GPU makes every benchmark below fail: stop here instead
  step kernel_tests 240 env PYTHONPATH=$PWD/src python -m pytest -q -x -p no:cacheprovider \
      tests/kernels/test_route_chunks.py tests/kernels/test_chunk_summaries.py tests/kernels/test_flash_attention.py \
      -k "routed or tile or chunk or policy or budget or scores or kmeans" || exit 1
  step routing_tests 150 env PYTHONPATH=$PWD/src python -m pytest -q -x -p no:cacheprovider \
      tests/cache/test_routing.py || exit 1
fi
[ "$PART" = tests ] && exit 0
lengths=("$@"); [ ${#lengths[@]} -eq 0 ] && lengths=(8192 32768)
bench() {  # bench NAME TREE LENGTHS POLICIES...
  local name=$1 tree=$2 length; read -ra lens <<< "$3"; shift 3
  for length in "${lens[@]}"; do
    batches="1 8"; [ "$length" -gt 16384 ] && batches=1
    step "${name}_$length" 200 env PYTHONPATH=$tree/src python -m flash_dllm.cli bench step --model random:/tmp/long \
        --methods dual-cache flash-cache --batch-sizes $batches --prompt-length "$length" --max-tokens 64 \
        --warmup 8 --iters 32 --kv-routing "$@" --kv-budget 0.125
  done
}
bench step "$PWD" "${lengths[*]}" dense chunk ${POLICIES:-}
[ -n "${BASE:-}" ] && bench base_step "$BASE" "${BASE_LENGTHS:-${lengths[*]}}" chunk
[ "${PROFILE:-1}" = 1 ] && step profile 150 env PYTHONPATH=$PWD/src python benchmarks/profile_step.py --model random:/tmp/long \
    --prompt-length 8192 --max-tokens 64 --cuda-graphs on --steps 6 --cases dual-cache:1:chunk flash-cache:1:chunk ${PROFILE_CASES:-}
pack_out h200_routing_check
