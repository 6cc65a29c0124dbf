#!/usr/bin/env bash
# The GPU checks a session starts with, each bounded in time and logged to $OUT as it goes (a device call is cut
# at 600 s and loses what it did not write): GPU tests of the engine, kernels and the methods' kernel paths,
# then the cached methods' tokens with CUDA graphs against eager, then `bench generate` at batch 1.
#   bash benchmarks/h200_check.sh        (on the device; PYTHONPATH is set here)
set -u
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/lib.sh"
step gpu_tests 240 python -m pytest -q -p no:cacheprovider tests/engine tests/kernels tests/decoding/test_elastic.py
step graphs_vs_eager 120 python - <<'PY'
from flash_dllm import LLM, SamplingParams
from flash_dllm.tasks import load_test_set
items = [item.prompt for item in load_test_set("trace")[:100]]
llms = {graphs: LLM(device="cuda", dtype="float32", cuda_graphs=graphs) for graphs in (True, False)}
for method in ("elastic", "flash-cache", "dual-cache", "prefix-cache", "flash-verify"):
    params = SamplingParams(method=method, threshold=0.9, max_tokens=128)
    out = {g: [o.token_ids for o in llm.generate(items, params, use_tqdm=False)] for g, llm in llms.items()}
    same = sum(a == b for a, b in zip(out[True], out[False]))
    print(f"{method} trace, graphs vs eager (fp32): {same}/{len(items)} identical", flush=True)
PY
step bench_generate_b1 240 python -m flash_dllm.cli bench generate --batch-sizes 1 \
    --methods prefix-cache dual-cache elastic flash-cache flash-verify
pack_out h200_check
