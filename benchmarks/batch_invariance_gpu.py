"""Batch invariance on the GPU at LLaDA-8B dims (random weights, bf16: near-ties everywhere): each method's tokens
for 16 prompts of 3-100 tokens alone against batches of 2, 8 and 32 (continuous batching refills the smaller
ones), and a second batch-32 run, in the default mode and with batch_invariant=True; with the wall time of the
batch-32 call. Then run `flash-dllm bench step` with and without --batch-invariant for the cost.

    PYTHONPATH=src python benchmarks/batch_invariance_gpu.py [--methods ...] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import time

import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.decoding.registry import METHODS
from flash_dllm.engine.llm_engine import LLMEngine

KNOBS = {"parallel": dict(threshold=0.9), "prefix-cache": dict(threshold=0.9), "dual-cache": dict(threshold=0.9),
         "flash-cache": dict(threshold=0.9), "flash-verify": dict(threshold=0.9)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", nargs="+", default=[m for m in METHODS if m != "elastic"])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", nargs="+", choices=["default", "invariant"], default=["default", "invariant"])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    lengths = [3, 100, 17, 64, 5, 41, 88, 9, 30, 72, 12, 55, 96, 23, 7, 47]
    prompts = [torch.randint(5, 126000, (n,), generator=g).tolist() for n in lengths]
    rows = []
    for invariant in [mode == "invariant" for mode in args.modes]:
        llm = LLM("random:llada-8b", device="cuda", dtype="bfloat16", batch_invariant=invariant, max_batch_size=32)
        for method in args.methods:
            params = SamplingParams(method=method, max_tokens=args.max_tokens, block_length=8,
                                    **KNOBS.get(method, {}))
            outputs, seconds = {}, 0.0
            for size in (1, 2, 8, 32, "32 again"):
                llm.engine = LLMEngine(llm.runner, llm.special, 32 if size == "32 again" else size)
                torch.cuda.synchronize()
                start = time.perf_counter()
                outputs[size] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            same = {size: sum(a == b for a, b in zip(outputs[1], out)) for size, out in outputs.items() if size != 1}
            rows.append((method, invariant, same, seconds))
            print(f"| {method} | {'invariant' if invariant else 'default'} | "
                  + " | ".join(f"{n}/16" for n in same.values()) + f" | {seconds:.2f} |", flush=True)
        del llm
        torch.cuda.empty_cache()
    print("\n| method | mode | identical: batch 2 | batch 8 | batch 32 | batch 32 again | batch-32 call s |")
    print("|---|---|---|---|---|---|---|")
    for method, invariant, same, seconds in rows:
        print(f"| {method} | {'invariant' if invariant else 'default'} | "
              + " | ".join(f"{n}/16" for n in same.values()) + f" | {seconds:.2f} |")


if __name__ == "__main__":
    main()
