#!/usr/bin/env bash
# Issue 15's A/B run on the device: this tree against another (BASE=<a `git archive` of its src/flash_dllm without
# assets/>) in one call, each step bounded in time and logged to $OUT as it goes:
#   tests    the GPU tests of the sampler, Elastic-Cache (its drift kernel) and the CUDA graphs;
#   tokens   the embedded tasks' tokens of every cached method, fp32, BASE's recording against this tree's;
#   bench    `bench generate` at the batch sizes and methods given, BASE first, then this tree;
#   anatomy  Elastic-Cache's batch-1 request step by step (benchmarks/elastic_anatomy.py), this tree, once per
#            ANATOMY="...;..." (the script's options per run, e.g. "--capture-after 1 --max-graphs 32").
#   BASE=base.tar [PART=tests,tokens,bench,anatomy] [BATCHES="1 32"] [METHODS="..."] [VARIANTS="..."] [ANATOMY=...]
#       bash benchmarks/h200_speed_check.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-tests,tokens,bench}
source "$(dirname "$0")/lib.sh"
base=/tmp/base_tree
if [ -n "${BASE:-}" ]; then
  rm -rf $base && mkdir -p $base && tar -xf "$BASE" -C $base
  ln -s "$PWD/src/flash_dllm/assets" $base/src/flash_dllm/assets
fi
if [[ $PART == *tests* ]]; then
  PYTHONPATH=$PWD/src step gpu_tests 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_greedy_tokens.py \
      tests/kernels/test_drift_cosine.py tests/decoding/test_sampling.py tests/decoding/test_elastic.py \
      tests/engine/test_cuda_graphs.py
fi
if [[ $PART == *tokens* && -n "${BASE:-}" ]]; then
  variants=${VARIANTS:-dual-cache flash-cache flash-verify elastic}
  PYTHONPATH=$base/src step tokens_base 150 python benchmarks/record_tokens.py --device cuda --items 30 \
      --variants $variants --out /tmp/tokens_base.json
  PYTHONPATH=$PWD/src step tokens_after 150 python benchmarks/record_tokens.py --device cuda --items 30 \
      --variants $variants --out /tmp/tokens_after.json --compare /tmp/tokens_base.json
fi
if [[ $PART == *bench* ]]; then
  for batch in ${BATCHES:-1 32}; do
    methods=${METHODS:-dual-cache flash-cache}
    [ -n "${BASE:-}" ] && TAIL=8 PYTHONPATH=$base/src step "bench_base_b$batch" 280 \
        python -m flash_dllm.cli bench generate --batch-sizes "$batch" --methods $methods
    TAIL=8 PYTHONPATH=$PWD/src step "bench_b$batch" 280 python -m flash_dllm.cli bench generate --batch-sizes "$batch" \
        --methods $methods
  done
fi
if [[ $PART == *anatomy* ]]; then
  IFS=';' read -ra runs <<< "${ANATOMY:- }"  # no ANATOMY: one run with the script's defaults
  for i in "${!runs[@]}"; do
    # shellcheck disable=SC2086  # the options split into words
    TAIL=9 PYTHONPATH=$PWD/src step "anatomy_b1_$i" 150 python -u benchmarks/elastic_anatomy.py --batch 1 --calls 1 \
        ${runs[$i]}
  done
fi
pack_out h200_speed_check
