#!/usr/bin/env bash
# Session 2's one GPU call: training run 6, its evaluation, kernel tests on the GPU, kernel micro-benchmarks,
# then the method table (kernels on) on the new model.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python training/train.py --assets training/tokenizer --out $OUT/model --init training/runs/s2/r5   # run 5, carried to the GPU --minutes 4.4 \
    --lr 5e-4 --short-batch 512 --passkey-tokens 16384 --arith-share 0.75 > $OUT/train.log 2>&1
tail -1 $OUT/train.log
cp $OUT/model/model.safetensors /tmp/r6.safetensors
(cd $OUT/model && split -b 12M model.safetensors model.part. && rm model.safetensors *.json)
mkdir -p /tmp/r6 && cp src/flash_dllm/assets/default/*.json /tmp/r6/ && cp /tmp/r6.safetensors /tmp/r6/model.safetensors
timeout 120 python -c 'from flash_dllm.cli import main; main()' demo --model /tmp/r6 --device cuda --dtype float32 \
    --items 200 --passkey-length 1024 --methods reference parallel > $OUT/eval.txt 2>&1; tail -8 $OUT/eval.txt
timeout 90 python -m pytest -q tests/kernels tests/models/test_kernel_path.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
timeout 60 python -m flash_dllm.cli bench kernels > $OUT/kernel_check.txt 2>&1; tail -30 $OUT/kernel_check.txt
timeout 140 python -c 'from flash_dllm.cli import main; main()' demo --model /tmp/r6 --device cuda --dtype float32 \
    --items 100 --passkey-length 1024 > $OUT/methods.txt 2>&1; tail -32 $OUT/methods.txt
