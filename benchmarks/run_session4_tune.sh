#!/usr/bin/env bash
# Session 4's third H200 call: tile search for the attention kernel's verify and key-mass variants, and where
# a batch-32 flash-verify / flash-cache step's GPU time goes.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 300 python benchmarks/tune_kernels.py --kernels attention \
    --attention-cases 32:112:verify 1:112:verify 32:144:mass 1:144:mass > $OUT/tune.txt 2>&1
tail -7 $OUT/tune.txt
timeout 150 python benchmarks/profile_step.py --cases flash-verify:32 flash-cache:32 --steps 3 > $OUT/profile32.txt 2>&1
tail -4 $OUT/profile32.txt
