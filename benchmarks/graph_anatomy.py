"""Where a request's iterations go by how their CUDA-graphed calls ran: each engine step timed (synchronised) and
classed as "capture" (some call was captured in it), "eager" (some ran eagerly, none captured), "replay" or
"none", through `LLM.generate` with `bench generate`'s prompts, warm-up and timed call (random LLaDA-8B, batch
1 by default), twice per method on one LLM.

    PYTHONPATH=src python benchmarks/graph_anatomy.py --methods dual-cache flash-cache flash-verify elastic
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time

import torch

import flash_dllm.engine.cuda_graphs as cuda_graphs
import flash_dllm.engine.llm_engine as llm_engine
from flash_dllm.bench.generate import random_prompts
from flash_dllm.decoding.registry import method_of
from flash_dllm.llm import LLM
from flash_dllm.sampling_params import SamplingParams


def how_it_runs(graphs: cuda_graphs.GraphedCalls, key: tuple, capture_after: int | None) -> str:
    """How GraphedCalls.run is about to run a call: "into capture", "replay", "capture" or "eager"."""
    return ("into capture" if graphs.read_by_capture is not None else "replay" if key in graphs.graphs
            else "capture" if graphs.capture_due(key, capture_after) else "eager")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llada-8b")
    ap.add_argument("--methods", nargs="+", default=["dual-cache", "flash-cache", "flash-verify", "elastic"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()

    steps: list[tuple[str, float]] = []
    hows: list[str] = []
    graphed_run, engine_step = cuda_graphs.GraphedCalls.run, llm_engine.LLMEngine.step

    def counted_run(self, key, fn, tensors=(), capture_after=None):
        hows.append(how_it_runs(self, key, capture_after))
        return graphed_run(self, key, fn, tensors, capture_after)

    def timed_step(self):
        hows.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        finished = engine_step(self)
        torch.cuda.synchronize()
        kind = next((how for how in ("capture", "eager", "replay") if how in hows), "none")
        steps.append((kind, (time.perf_counter() - start) * 1e3))
        return finished

    cuda_graphs.GraphedCalls.run, llm_engine.LLMEngine.step = counted_run, timed_step
    llm = LLM(args.model, device="cuda")
    prompts = random_prompts(llm, args.batch, args.prompt_length, seed=0)
    kinds = ("capture", "eager", "replay", "none")
    print("| method | call | ms/iter | steps | " + " | ".join(f"{k}: steps, median ms, sum s" for k in kinds) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.methods:
        params = SamplingParams(method=name, max_tokens=args.max_tokens)
        warm_tokens = min(args.max_tokens, 2 * params.block_length if method_of(name).uses_blocks else 32)
        llm.generate(prompts, dataclasses.replace(params, max_tokens=warm_tokens), use_tqdm=False)  # as the bench
        for call in (1, 2):
            steps.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3
            by_kind = collections.defaultdict(list)
            for kind, ms in steps:
                by_kind[kind].append(ms)
            cells = [f"{len(t)}, {statistics.median(t):.2f}, {sum(t) / 1e3:.2f}" if (t := by_kind.get(k)) else "-"
                     for k in kinds]
            print(f"| {name} | {call} | {wall / len(steps):.2f} | {len(steps)} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
