#!/usr/bin/env bash
# Issue 37's device run, in one call, each step bounded in time and logged to $OUT:
#   cold     benchmarks/cold_start.py: process start to the first cached result with an empty Triton cache (a fresh
#            machine), then with the cache that run filled; the server's start to /health ok and its first answer;
#   tests    the GPU tests of the CUDA graphs (ragged last blocks included), the kernel path, the warm-up and the
#            host syncs;
#   tokens   the embedded tasks' tokens of every cached method, fp32, BASE's recording against this tree's.
#   BASE=.whl/base.tar (a `git archive` of the src/flash_dllm before the change, without assets/) WHEELS=.whl
#       bash benchmarks/h200_first_hour.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/lib.sh"
if [ -n "${WHEELS:-}" ]; then  # the server's packages (the GPU image has no FastAPI/uvicorn)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
TAIL=12 step cold 150 python benchmarks/cold_start.py --src src --out /tmp/cold --budget-s 100
PYTHONPATH=$PWD/src:${PYTHONPATH:-} step gpu_tests 150 python -m pytest -q -p no:cacheprovider \
    tests/engine/test_cuda_graphs.py tests/models/test_kernel_path.py tests/engine/test_warmup.py \
    tests/engine/test_host_syncs.py tests/kernels/test_greedy_tokens.py
if [ -n "${BASE:-}" ]; then
  base=/tmp/base_tree
  rm -rf $base && mkdir -p $base && tar -xf "$BASE" -C $base
  ln -s "$PWD/src/flash_dllm/assets" $base/src/flash_dllm/assets
  variants=${VARIANTS:-dual-cache flash-cache flash-verify elastic}
  PYTHONPATH=$base/src step tokens_base 80 python benchmarks/record_tokens.py --device cuda --items 20 \
      --variants $variants --out /tmp/tokens_base.json
  PYTHONPATH=$PWD/src step tokens_after 80 python benchmarks/record_tokens.py --device cuda --items 20 \
      --variants $variants --out /tmp/tokens_after.json --compare /tmp/tokens_base.json
fi
pack_out h200_first_hour
