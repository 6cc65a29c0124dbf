#!/usr/bin/env bash
# Issue 57's device runs, logged to $OUT: the embedded model trained further with the choice tasks (pairs, perm,
# pick) among its short items (training/train.py --init, as run 9's settings otherwise), to $OUT/dense/model, then
# benchmarks/choice_eval.py on it (fixed k, thresholds, Flash-Verify on the choice tasks; arith and trace beside the
# shipped model). The model comes back as $OUT/dense.tgz.part-* (the device returns files of at most 16 MiB:
# `cat dense.tgz.part-* | tar xz`). MINUTES: the training's budget (default 5); CHOICE: the choice tasks' share of
# the short items (default 0.4); LR (default 3e-4); WORKERS (default 12); INIT: the checkpoint it starts from
# (default: the shipped model; an earlier run's model to resume it).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
source "$(dirname "$0")/lib.sh"
ASSETS=src/flash_dllm/assets/default
TAIL=8 step dense_train $((${MINUTES:-5} * 60 + 60)) python training/train.py --assets $ASSETS --init "${INIT:-$ASSETS}" \
    --out "$OUT/dense/model" --minutes "${MINUTES:-5}" --lr "${LR:-3e-4}" --short-batch 512 --retrieval-tokens 24576 \
    --arith-share 0.75 --multikey-share 0.75 --retrieval-lengths 128 8032 --choice-share "${CHOICE:-0.4}" \
    --workers "${WORKERS:-12}"
TAIL=40 step choice_eval 200 python benchmarks/choice_eval.py --model "$OUT/dense/model" --baseline $ASSETS --items 200
(cd "$OUT" && tar czf - dense | split -b 15M - dense.tgz.part- && rm -r dense)
