#!/usr/bin/env bash
# `flash-dllm bench serve` against a server on random LLaDA-8B weights, then the same prompts through
# LLM.generate in one process (the engine without HTTP), on the same GPU. Logs go to $1 (default: .).
# usage: benchmarks/serve_vs_offline.sh OUT_DIR [CLIENTS] [DURATION_S]
# SERVE_ARGS replaces the server's flags, PROMPT_LENGTH the prompts' length; OFFLINE=0 skips the offline run
# (which decodes the default setting).
set -u
source "$(dirname "$0")/lib.sh"
out=${1:-.}; clients=${2:-64}; duration=${3:-60}
serve_args=${SERVE_ARGS:-"--model random:llada-8b --method flash-cache --max-tokens 256 --block-length 32 --max-batch 32"}
python -m flash_dllm.cli serve --port 8123 $serve_args > "$out/server.log" 2>&1 &
pid=$!
wait_ready $pid "$out/server.log" 240 || { kill $pid 2> /dev/null; exit 1; }
echo "server up after ${READY_S} s"
python -m flash_dllm.cli bench serve --url http://127.0.0.1:8123 --clients "$clients" --duration "$duration" \
  --prompts random --num-prompts 32 --prompt-length "${PROMPT_LENGTH:-256}" > "$out/bench_serve.md" 2> "$out/bench_serve.err"
python -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/metrics').read().decode())" > "$out/metrics.txt"
kill -INT $pid; wait $pid
tail -3 "$out/bench_serve.err"
grep -E "^flash_dllm_(requests_total|tokens_per|nfe_per|kv_cache)" "$out/metrics.txt"
[ "${OFFLINE:-1}" = 1 ] && python - <<'PY' 2>&1 | tee "$out/offline.txt" | tail -1
import random, time, torch
from flash_dllm import LLM, SamplingParams
llm = LLM("random:llada-8b", max_batch_size=32)
rng = random.Random(0)  # bench serve's random prompt pool
prompts = [[rng.randrange(1000) for _ in range(256)] for _ in range(32)]
params = [SamplingParams(method="flash-cache", max_tokens=256, block_length=32, seed=k) for k in range(32)]
llm.generate(prompts, params, use_tqdm=False)  # warm-up
start = time.perf_counter()
outs = llm.generate(prompts * 2, params * 2, use_tqdm=False)
torch.cuda.synchronize()
wall = time.perf_counter() - start
tokens = sum(len(o.token_ids) for o in outs)
print(f"offline LLM.generate, batch 32: {len(outs)} requests in {wall:.1f} s: {len(outs) / wall:.2f} requests/s, "
      f"{tokens / wall:.1f} tokens/s, NFE {sum(o.nfe for o in outs) / len(outs):.1f}, "
      f"tokens/step {tokens / sum(o.steps for o in outs):.2f}")
PY
cat "$out/bench_serve.md"
