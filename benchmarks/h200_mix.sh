#!/usr/bin/env bash
# Issue 40's device runs (steady latency under mixed traffic), each step bounded in time and logged to $OUT
# (PART picks which):
#   PART=check   the GPU tests of the warm-up, graphs and counters; `bench mix` offline, a short mix, before
#                (--no-warm-up-requests: the KV cache and compile_kernels only) and after (serve's warm-up)
#   PART=serve   `serve` (random LLaDA-8B, bf16, flash-cache defaults) timed to ready on this machine's Triton cache,
#                then `bench serve --mix` at a rate that keeps the batch at 8-32, and /metrics after
#   PART=cold    the same start-up with an empty Triton cache (TRITON_CACHE_DIR fresh): the <= 60 s budget
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, print its last lines
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "## $name (rc $?)"; tail -n "${TAIL:-4}" "$OUT/$name.txt"
}
MIX="--rate ${RATE:-3} --requests ${REQUESTS:-300} --mix-prompt-lengths 64 256 1024 4096 8192 --mix-max-tokens 32 128 512"
serve_and_mix() {  # serve_and_mix NAME: start a server, time it to ready, run the mix against it, keep /metrics
  local name=$1 start=$SECONDS
  python -m flash_dllm.cli serve --model random:llada-8b --method flash-cache --max-batch 32 --port 8123 \
      > "$OUT/${name}_server.txt" 2>&1 &
  local pid=$!
  until curl -sf localhost:8123/health > /dev/null; do
    sleep 1; kill -0 $pid 2> /dev/null || { echo "server died"; tail "$OUT/${name}_server.txt"; return; }
    [ $((SECONDS - start)) -gt 300 ] && { echo "not ready in 300 s"; kill $pid; return; }
  done
  echo "## ${name}: ready after $((SECONDS - start)) s"
  curl -s localhost:8123/metrics > "$OUT/${name}_metrics_ready.txt"
  [ "${MIX_RUN:-1}" = 1 ] && TAIL=30 step "${name}_mix" "${MIX_S:-420}" python -m flash_dllm.cli bench serve \
      --url http://127.0.0.1:8123 --mix $MIX
  curl -s localhost:8123/metrics > "$OUT/${name}_metrics_end.txt"
  grep -E "after_ready|step_seconds|start_up" "$OUT/${name}_metrics_end.txt"
  kill $pid; wait $pid 2> /dev/null
}
case "${PART:-check}" in
check)
  step gpu_tests 200 python -m pytest -q -p no:cacheprovider tests/engine/test_warmup.py tests/engine/test_cuda_graphs.py \
      tests/engine/test_counters.py tests/bench/test_mix.py
  TAIL=30 step mix_before 200 python -m flash_dllm.cli bench mix --no-warm-up-requests --rate 2 --requests 60 \
      --mix-prompt-lengths 64 1024 8192 --mix-max-tokens 32 128
  TAIL=30 step mix_after 260 python -m flash_dllm.cli bench mix --rate 2 --requests 60 \
      --mix-prompt-lengths 64 1024 8192 --mix-max-tokens 32 128 ;;
serve)
  serve_and_mix warm ;;
cold)
  export TRITON_CACHE_DIR=$(mktemp -d)
  MIX_RUN=0 serve_and_mix cold ;;
esac
