#!/usr/bin/env bash
# One device call: versions, the test suite, GPU correctness, then the forward and step benchmarks.
#   bash benchmarks/run_foundation.sh   (on the GPU machine; logs under $OUT)
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cli() { python -c 'import sys; from flash_dllm.cli import main; sys.exit(main())' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/machine.txt"
python -m pytest -q -p no:cacheprovider tests 2>&1 | tail -3 | tee "$OUT/pytest.txt"
python benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.txt"
cli bench forward --model random:llada-8b --batch-sizes 1 32 --length 512 --iters 10 2>&1 | tee "$OUT/forward.txt"
cli bench step --model random:llada-8b --methods reference --batch-sizes 1 32 --prompt-length 256 \
    --max-tokens 256 --block-length 32 --iters 32 2>&1 | tee "$OUT/step_reference.txt"
cli bench step --model random:llada-8b --methods parallel --batch-sizes 1 --prompt-length 256 \
    --max-tokens 256 --block-length 32 --iters 32 2>&1 | tee "$OUT/step_parallel.txt"
echo "=== summary"; cat "$OUT/gpu_check.txt" "$OUT/forward.txt" "$OUT/step_reference.txt" "$OUT/step_parallel.txt"
