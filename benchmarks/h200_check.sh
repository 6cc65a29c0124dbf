#!/usr/bin/env bash
# The GPU checks a session starts with, each bounded in time and logged to $OUT as it goes (a device call is cut
# at 600 s and loses what it did not write): GPU tests of the engine, kernels and the methods' kernel paths,
# then Elastic-Cache's tokens with CUDA graphs against eager, then `bench generate` at batch 1.
#   bash benchmarks/h200_check.sh        (on the device; PYTHONPATH is set here)
set -u
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, print its last lines
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "## $name (rc $?)"; tail -n 4 "$OUT/$name.txt"
}
step gpu_tests 240 python -m pytest -q -p no:cacheprovider tests/engine tests/kernels tests/decoding/test_elastic.py
step elastic_eager 60 python - <<'PY'
import json, flash_dllm.engine.model_runner as m
from flash_dllm import LLM, SamplingParams
from flash_dllm.tasks import load_test_set
items = [item.prompt for item in load_test_set("trace")[:100]]
params = SamplingParams(method="elastic", threshold=0.9, max_tokens=128)
graphs = [o.token_ids for o in LLM(device="cuda", dtype="float32").generate(items, params, use_tqdm=False)]
m.ModelRunner.uses_graphs = lambda self, rows: False  # eager
eager = [o.token_ids for o in LLM(device="cuda", dtype="float32").generate(items, params, use_tqdm=False)]
print(f"elastic trace, graphs vs eager (fp32): {sum(a == b for a, b in zip(graphs, eager))}/{len(items)} identical")
PY
step bench_generate_b1 240 python -m flash_dllm.cli bench generate --batch-sizes 1 \
    --methods dual-cache elastic flash-cache flash-verify
