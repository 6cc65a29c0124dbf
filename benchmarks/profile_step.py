"""Where an engine step's time goes on the GPU: torch.profiler over a few steps per case, GPU
busy time against wall time, the top kernels, and the same step's forward pass replayed as a CUDA graph.

    python benchmarks/profile_step.py --model random:llada-8b --cases flash-cache:1 flash-cache:32 dual-cache:1
    python benchmarks/profile_step.py --model random:<long config> --prompt-length 8192 --cases dual-cache:1:chunk
    python benchmarks/profile_step.py --cases elastic:32 --skip 300 --steps 4
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from flash_dllm.cache import KVCache
from flash_dllm.decoding.registry import method_of
from flash_dllm.engine.llm_engine import LLMEngine
from flash_dllm.engine.model_runner import ModelRunner
from flash_dllm.llm import LLM
from flash_dllm.sampling_params import SamplingParams


class RecordingRunner(ModelRunner):
    """The runner, keeping every cached pass it runs (to replay the last one alone)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def run(self, p, key_mass=None):
        self.calls.append((p, key_mass))
        return super().run(p, key_mass)


def make_engine(llm, method, batch, prompt_length, max_tokens, routing=None, budget=0.125):
    decoding = method_of(method)
    params = SamplingParams(method=method, max_tokens=max_tokens, block_length=decoding.published_block_length,
                            **({} if routing is None else dict(kv_routing=routing, kv_budget=budget)))
    cfg = llm.config
    row_bytes = KVCache.bytes_per_row(cfg, llm.dtype, decoding.caches_hidden_states)
    runner = RecordingRunner(llm.model, kernels=llm.runner.kernels, cuda_graphs=llm.runner.cuda_graphs,
                             kv_cache_bytes=batch * (prompt_length + max_tokens) * row_bytes,
                             batch_invariant=llm.runner.batch_invariant)
    engine = LLMEngine(runner, dataclasses.replace(llm.special, stop_ids=()), batch)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        prompt = torch.randint(0, cfg.vocab_size, (prompt_length,), generator=g)
        prompt[prompt == llm.special.mask_id] = llm.special.pad_id
        engine.add_request(prompt.tolist(), params)
    return engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llada-8b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kernels", choices=["on", "off"], default="on")
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="off")
    ap.add_argument("--cases", nargs="+", default=["flash-cache:1"],
                    help="method:batch, or method:batch:routing (a kv_routing policy at --kv-budget)")
    ap.add_argument("--kv-budget", type=float, default=0.125)
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=4, help="steps run before the timed ones (e.g. 300: late in a request, "
                                                        "where Elastic-Cache's refreshes may differ)")
    ap.add_argument("--batch-invariant", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, device="cuda", dtype=args.dtype, kernels=args.kernels == "on",
              cuda_graphs=args.cuda_graphs == "on", batch_invariant=args.batch_invariant)
    summary = []
    for case in args.cases:
        method, batch, *routing = case.split(":")
        engine = make_engine(llm, method, int(batch), args.prompt_length, args.max_tokens,
                             routing[0] if routing else None, args.kv_budget)
        runner = engine.runner
        for _ in range(args.skip):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        calls = runner.calls
        events = prof.key_averages()
        # GPU busy: the kernels' own durations (an op's self device time counts its kernels a second time)
        gpu_ms = sum(e.time_range.elapsed_us() for e in prof.events()
                     if e.device_type == DeviceType.CUDA) / 1e3 / args.steps
        print(f"\n## {case} (kernels {args.kernels}, graphs {args.cuda_graphs}): wall {wall:.2f} ms/step, "
              f"GPU busy {gpu_ms:.2f} ms/step")
        print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
        print(events.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
        graph_ms = eager_ms = float("nan")
        if calls:  # the last cached forward of the step, eager and as a replayed CUDA graph
            p, key_mass = calls[-1]
            with torch.inference_mode():
                def run():
                    return runner.model.forward_cached(p.input_ids, p.positions, p.metadata, runner.cache, key_mass,
                                                       runner.kernels)
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(10):
                    run()
                torch.cuda.synchronize()
                eager_ms = (time.perf_counter() - t) * 100
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                graph.replay()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(10):
                    graph.replay()
                torch.cuda.synchronize()
                graph_ms = (time.perf_counter() - t) * 100
        summary.append((case, wall, gpu_ms, len(calls) / (2 * args.steps + args.skip), eager_ms, graph_ms))
        del engine
        torch.cuda.empty_cache()
    print(f"\n| case (kernels {args.kernels}, graphs {args.cuda_graphs}) | wall ms/step | GPU busy ms/step | "
          "eager cached passes/step | last eager forward ms | as CUDA graph ms |")
    print("|---|---|---|---|---|---|")
    for case, wall, gpu, passes, eager, graph in summary:
        print(f"| {case} | {wall:.2f} | {gpu:.2f} | {passes:.2f} | {eager:.2f} | {graph:.2f} |")


if __name__ == "__main__":
    main()
