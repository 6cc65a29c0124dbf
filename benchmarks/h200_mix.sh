#!/usr/bin/env bash
# Issue 40's device runs (steady latency under mixed traffic), each step bounded in time and logged to $OUT
# (PART picks which):
#   PART=mix      the first step of PART=offline alone
#   PART=alone    its last two steps alone
#   PART=probe    issue 40's table: each method's first call of a new batch shape after the warm-up, against its
#                 repeat (benchmarks/first_call_probe.py)
#   PART=offline  `bench mix` (random LLaDA-8B, bf16) after serve's warm-up (engine/warmup.before_ready): the mix of
#                 every cached method, dense and chunk-routed, at 1 request/s; then one method and generation length
#                 (flash-cache, 128 tokens; prompts 64-4k) at RATE, whose batch reaches 8-32, with no CUDA graph
#                 captured after ready (as `serve` now runs) and with graphs captured lazily (--capture-after-ready,
#                 as before): the throughput that stopping the captures costs; then the same one request at a time
#   PART=serve    `serve` (flash-cache defaults) timed to ready on this machine's Triton cache, then
#                 `bench serve --mix` and /metrics after
#   PART=cold     the same start-up with an empty Triton cache (TRITON_CACHE_DIR fresh): the <= 60 s budget
#   PART=before_after  `bench serve --mix` (this checkout's client) against the server as it was before issue 40
#                 (commit c6f99ee's src/, which the caller extracts into .before/ and carries:
#                 `git archive c6f99ee src | tar -x -C .before`) and against this checkout's, the same mix
#   PART=before / PART=after  its two halves, one device call each; `after` then restarts the server on the warm
#                 Triton cache and times it to ready (the <= 15 s budget)
#   PART=startup  PART=cold, then the server restarted on that Triton cache (the <= 15 s budget), then PART=probe
#                 (PROBE=0: not)
#   PART=steady   the issue's long run: `serve`, then `bench serve --mix` of one method and generation length
#                 (SINGLE, so that one batch takes every request) at RATE (unset: 0.85 of what SINGLE serves offline
#                 when offered more) for ARRIVE_S seconds of arrivals, the load sampled from /metrics;
#                 ARRIVALS=even: the same requests evenly spaced (the spread of equal requests' latency that is left
#                 is the engine's); MIX_ROUTINGS: the routings (default dense and chunk; "dense": no routed step, so
#                 every steady pass replays a graph)
#   PART=front    PART=steady's mix (RATE 1.4, ARRIVALS even, ARRIVE_S 150) served twice: the engine loop in the
#                 HTTP front's process, then in a process of its own (`serve --engine-process`): what the front's
#                 Python work costs the engine's steps (FRONT_MODES="engine_process in_process": the other order)
#   SERVE_ARGS    more `serve` flags for every part that serves (e.g. "--methods flash-cache": no room for hidden
#                 states in the KV cache, about 1.5x its rows)
#   PART=trace    PART=steady's mix offline (benchmarks/mix_trace.py): every step's time, rows and query rows, every
#                 request's latency, then the breakdown (a fit of step time on the batch's make-up, the slowest
#                 requests, the worst step per minute); ARRIVALS default "even poisson" (one trace each, one model), RATE
#                 default 1.4, TRACE_REQUESTS 150
#   PART=graph_sizes  the steady passes captured before ready for batch sizes 2-4 too (`serve --graph-batch-sizes`):
#                 a dense one-key mix of a few requests at a time (RATE default 0.8, REQUESTS 16) before and after
#                 (benchmarks/graph_batch_sizes.py): each batch size's median steady step, the captures' cost
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # carried wheels (serve) stay on the path
source "$(dirname "$0")/lib.sh"
FILTER="grep -v variant/s"
# random LLaDA-8B holds 4,096 positions: prompt + max_tokens stay within them
MIX="--rate ${RATE:-3} --requests ${REQUESTS:-300} --mix-prompt-lengths 64 256 1024 3584 --mix-max-tokens ${MIX_MAX_TOKENS:-32 128 512}"
serve_and_mix() {  # serve_and_mix NAME: start a server, time it to ready, run the mix against it, keep /metrics
  local name=$1 start=$SECONDS
  PYTHONPATH=${SERVE_SRC:+$SERVE_SRC:}$PYTHONPATH python -m flash_dllm.cli serve --model random:llada-8b --method flash-cache --max-batch 32 --port 8123 ${SERVE_ARGS:-} \
      > "$OUT/${name}_server.txt" 2>&1 &
  local pid=$!
  wait_ready $pid "$OUT/${name}_server.txt" 300 || { kill $pid 2> /dev/null; return; }
  echo "## ${name}: ready after $((SECONDS - start)) s"
  curl -s localhost:8123/metrics > "$OUT/${name}_metrics_ready.txt"
  [ "${MIX_RUN:-1}" = 1 ] && TAIL=30 step "${name}_mix" "${MIX_S:-420}" python -m flash_dllm.cli bench serve \
      --url http://127.0.0.1:8123 --mix $MIX --mix-save "$OUT/${name}_requests.jsonl"
  curl -s localhost:8123/metrics > "$OUT/${name}_metrics_end.txt"
  grep -E "after_ready|step_seconds|start_up" "$OUT/${name}_metrics_end.txt"
  kill $pid; wait $pid 2> /dev/null
}
serve_before() {  # the server before issue 40, extracted by the caller into .before/src
  [ -d .before/src ] || { echo "no .before/src: extract commit c6f99ee's src there and carry it"; exit 1; }
  SERVE_SRC=$PWD/.before/src serve_and_mix before
}
BENCH="python -m flash_dllm.cli bench mix"
every_method() {
  TAIL=40 step mix_every_method 240 $BENCH --rate 1 --requests "${MIX_REQUESTS:-30}" --mix-prompt-lengths 64 300 1024 3968 \
      --mix-routings ${MIX_ROUTINGS:-dense chunk centroid kmeans window random} \
      --mix-max-tokens 32 128
}
SINGLE="--mix-methods flash-cache --mix-max-tokens 128 --mix-prompt-lengths 64 256 1024 3968"
alone() {  # one request at a time: the cost of eager steps, where only passes replay
  TAIL=14 step alone_no_captures 90 $BENCH $SINGLE --rate 0.3 --requests 8
  TAIL=14 step alone_lazy_captures 90 $BENCH $SINGLE --rate 0.3 --requests 8 --capture-after-ready
}
case "${PART:-offline}" in
mix)
  every_method ;;
probe)
  TAIL=40 step first_call_probe "${PROBE_S:-300}" python benchmarks/first_call_probe.py ;;
offline)
  every_method
  TAIL=12 step batched_no_captures 110 $BENCH $SINGLE --rate "${RATE:-8}" --requests "${REQUESTS:-150}"
  TAIL=12 step batched_lazy_captures 110 $BENCH $SINGLE --rate "${RATE:-8}" --requests "${REQUESTS:-150}" \
      --capture-after-ready
  alone ;;
alone)
  alone ;;
serve)
  serve_and_mix warm ;;
cold)
  export TRITON_CACHE_DIR=$(mktemp -d)
  MIX_RUN=0 serve_and_mix cold ;;
startup)
  export TRITON_CACHE_DIR=$(mktemp -d)
  MIX_RUN=0 serve_and_mix cold
  MIX_RUN=0 serve_and_mix warm_restart
  [ "${PROBE:-1}" = 1 ] && TAIL=40 step first_call_probe "${PROBE_S:-300}" python benchmarks/first_call_probe.py ;;
steady)
  if [ -z "${RATE:-}" ]; then  # 0.85 of what the mix serves offline when offered more than it can
    TAIL=12 step capacity 150 $BENCH $SINGLE --rate 8 --requests "${CAPACITY_REQUESTS:-60}"
    RATE=$(python - "$OUT/capacity.txt" <<'PY'
import sys
lines = [line for line in open(sys.argv[1]) if line.startswith("|")]
row = lines[[i for i, line in enumerate(lines) if "requests/s" in line][0] + 2].split("|")
print(round(0.85 * float(row[4]), 2))
PY
)
    echo "## rate: $RATE requests/s"
  fi
  REQUESTS=$(python -c "print(max(1, int($RATE * ${ARRIVE_S:-420})))") MIX_S=$((${ARRIVE_S:-420} + 60))
  MIX="--rate $RATE --requests $REQUESTS --mix-arrivals ${ARRIVALS:-poisson} $SINGLE ${MIX_ROUTINGS:+--mix-routings $MIX_ROUTINGS}"
  serve_and_mix steady ;;
front)
  MIX="--rate ${RATE:-1.4} --requests $(python -c "print(int(${RATE:-1.4} * ${ARRIVE_S:-150}))") --mix-arrivals ${ARRIVALS:-even} $SINGLE"
  for mode in ${FRONT_MODES:-in_process engine_process}; do
    [ "$mode" = engine_process ] && engine=--engine-process || engine=
    SERVE_ARGS="${SERVE_ARGS:-} $engine" MIX_S=$((${ARRIVE_S:-150} + 60)) serve_and_mix "front_$mode"
  done
  for mode in ${FRONT_MODES:-in_process engine_process}; do
    echo "## $mode"; grep "^|" "$OUT/front_${mode}_mix.txt" | grep -v "^|---"
  done ;;
trace)
  TAIL=3 step trace "${TRACE_S:-480}" python benchmarks/mix_trace.py --rate "${RATE:-1.4}" \
      --requests "${TRACE_REQUESTS:-150}" --arrivals ${ARRIVALS:-even poisson} --out "$OUT/trace_{arrivals}.json"
  for arrivals in ${ARRIVALS:-even poisson}; do
    python benchmarks/mix_trace.py --analyse "$OUT/trace_$arrivals.json" > "$OUT/analysis_$arrivals.txt"
  done
  tail -n 40 "$OUT"/analysis_*.txt ;;
graph_sizes)
  TAIL=16 step graph_batch_sizes "${GRAPH_S:-300}" python benchmarks/graph_batch_sizes.py --rate "${RATE:-0.8}" \
      --requests "${REQUESTS:-16}" ;;
before_after)
  serve_before
  serve_and_mix after ;;
before)
  serve_before ;;
after)
  serve_and_mix after
  MIX_RUN=0 serve_and_mix warm_restart ;;
esac
pack_out "mix_${PART:-offline}"
