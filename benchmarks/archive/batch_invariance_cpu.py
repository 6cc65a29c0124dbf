"""Batch invariance on the CPU: each method's tokens for 16 prompts alone against one batch of 32, in the default mode
and with batch_invariant=True, and the batch-32 generate time of each (random LLaDA-tiny weights, bf16).

    PYTHONPATH=src python benchmarks/archive/batch_invariance_cpu.py
"""
import time

import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.decoding.registry import METHODS

KNOBS = {"parallel": dict(threshold=0.9), "prefix-cache": dict(threshold=0.9), "dual-cache": dict(threshold=0.9),
         "flash-cache": dict(threshold=0.9, tracking_budget=6, mask_window=8),
         "flash-verify": dict(threshold=0.9, tracking_budget=6, mask_window=8, verify_threshold=0.3),
         "elastic": dict(threshold=0.9, mask_window=6, drift_threshold=0.95)}
LENGTHS = [3, 100, 17, 64, 5, 41, 88, 9, 30, 72, 12, 55, 96, 23, 7, 47]


def main():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 320, (n,), generator=g).tolist() for n in LENGTHS]
    print("| method | default: identical alone vs batch 32 | invariant: identical | default batch-32 s "
          "| invariant batch-32 s |")
    print("|---|---|---|---|---|")
    llms = {(invariant, size): LLM("random:llada-tiny", device="cpu", dtype="bfloat16", max_batch_size=size,
                                   batch_invariant=invariant)
            for invariant in (False, True) for size in (1, 32)}
    for method in METHODS:
        params = SamplingParams(method=method, max_tokens=16, block_length=8, **KNOBS.get(method, {}))
        identical, seconds = [], []
        for invariant in (False, True):
            alone = [o.token_ids for o in llms[invariant, 1].generate(prompts, params, use_tqdm=False)]
            llms[invariant, 32].generate(prompts, params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            batched = [o.token_ids for o in llms[invariant, 32].generate(prompts, params, use_tqdm=False)]
            seconds.append(time.perf_counter() - start)
            identical.append(f"{sum(a == b for a, b in zip(alone, batched))}/{len(prompts)}")
        print(f"| {method} | {identical[0]} | {identical[1]} | {seconds[0]:.2f} | {seconds[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
