"""Where Elastic-Cache's requests spend their steps: per step its reuse pass's rows, whether and from which layer
it refreshed, how each graphed call ran (eager, captured, replayed) and the step's wall time (the steps without
a refresh also by how their reuse pass ran), through `LLM.generate` (random LLaDA-8B, one request per prompt, the
bench's prompts), twice on one LLM.

    PYTHONPATH=src python benchmarks/elastic_anatomy.py --batch 1 [--max-graphs 16] [--capture-after 3]

(--capture-after sets the graphs' default; Elastic's refresh asks for its own.)
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import flash_dllm.decoding.elastic as elastic
import flash_dllm.engine.cuda_graphs as cuda_graphs
from flash_dllm.bench.generate import random_prompts
from flash_dllm.llm import LLM
from flash_dllm.sampling_params import SamplingParams
from graph_anatomy import how_it_runs  # this script's directory


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llada-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-graphs", type=int, default=None)
    ap.add_argument("--capture-after", type=int, default=None)
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    if args.capture_after is not None:
        cuda_graphs.CAPTURE_AFTER = args.capture_after

    steps: list[dict] = []
    runs: collections.Counter = collections.Counter()
    reuse_pass, refresh_pass, graphed_run = elastic._reuse_pass, elastic._refresh_pass, cuda_graphs.GraphedCalls.run
    step = elastic.Elastic.step

    def timed_step(self, runner, batch):
        torch.cuda.synchronize()
        start = time.perf_counter()
        steps.append({"refresh": None})
        step(self, runner, batch)
        torch.cuda.synchronize()
        steps[-1]["ms"] = (time.perf_counter() - start) * 1e3

    def counted_reuse(runner, batch, reuse, tracked, drift):
        steps[-1]["rows"] = reuse.input_ids.shape[0]
        return reuse_pass(runner, batch, reuse, tracked, drift)

    def counted_refresh(runner, batch, first_layer, predicting, key_mass):
        layers = len(runner.model.layers)
        refreshing = [first for first in first_layer if first < layers]
        if refreshing:
            steps[-1]["refresh"] = (len(refreshing), min(refreshing))
        return refresh_pass(runner, batch, first_layer, predicting, key_mass)

    def counted_run(self, key, fn, tensors=(), capture_after=None):
        kind = key[0] if isinstance(key[0], str) else "pass"
        how = how_it_runs(self, key, capture_after)
        runs[(kind, how)] += 1
        if kind == "elastic reuse" and steps:
            steps[-1]["reuse"] = how
        return graphed_run(self, key, fn, tensors, capture_after)

    elastic.Elastic.step, elastic._reuse_pass, elastic._refresh_pass = timed_step, counted_reuse, counted_refresh
    cuda_graphs.GraphedCalls.run = counted_run

    llm = LLM(args.model, device="cuda")
    prompts = random_prompts(llm, args.batch, args.prompt_length, seed=0)
    params = SamplingParams(method="elastic", max_tokens=args.max_tokens)
    llm.generate(prompts, SamplingParams(method="elastic", max_tokens=32), use_tqdm=False)  # the bench's warm-up
    if args.max_graphs is not None:
        llm.runner.graphs.max_graphs = args.max_graphs
    for call in range(args.calls):
        steps.clear()
        runs.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        refreshed = [s for s in steps if s["refresh"] is not None]
        quiet = [s["ms"] for s in steps if s["refresh"] is None]
        firsts = collections.Counter(s["refresh"][1] for s in refreshed)
        print(f"\n## call {call + 1}: batch {args.batch}, {len(steps)} steps, {wall * 1e3 / len(steps):.2f} ms/step "
              f"(wall {wall:.2f} s); graphs kept {len(llm.runner.graphs.graphs)}")
        print(f"reuse rows: {len(set(s['rows'] for s in steps))} distinct, "
              f"{sorted(collections.Counter(s['rows'] for s in steps).items())}")
        print(f"steps without refresh: {len(quiet)}, median {statistics.median(quiet) if quiet else 0:.2f} ms, "
              f"sum {sum(quiet) / 1e3:.2f} s")
        for how in ("replay", "eager", "capture", "not graphed"):  # where the quiet steps' wall time goes
            times = [s["ms"] for s in steps if s["refresh"] is None and s.get("reuse", "not graphed") == how]
            if times:
                print(f"  quiet steps whose reuse pass ran {how}: {len(times)}, median {statistics.median(times):.2f}"
                      f" ms, sum {sum(times) / 1e3:.2f} s")
        if refreshed:
            print(f"steps with refresh: {len(refreshed)}, median "
                  f"{statistics.median(s['ms'] for s in refreshed):.2f} ms, sum "
                  f"{sum(s['ms'] for s in refreshed) / 1e3:.2f} s; rows refreshing (mean) "
                  f"{statistics.mean(s['refresh'][0] for s in refreshed):.1f}; first layers {sorted(firsts.items())}")
        print("graphed calls:", dict(sorted(runs.items())))


if __name__ == "__main__":
    main()
