"""Where `serve`'s start-up goes: engine/warmup.before_ready's phases, and per warm-up request group (method,
routing) its time, engine steps, and the kernel variants it compiled or loaded (and at which step of its call).

    python benchmarks/warm_up_anatomy.py [--model random:llada-8b]

Run it twice: the first process fills Triton's disk cache (a fresh machine), the second is a warm start. A group
whose calls launch no new variant is, for the kernels, redundant after the groups before it.
"""
from __future__ import annotations

import argparse
import itertools
import time
from collections import defaultdict

import torch

from flash_dllm import LLM
from flash_dllm.engine import warmup
from flash_dllm.engine.counters import COUNTERS
from flash_dllm.markdown import markdown_table


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llada-8b")
    args = parser.parse_args()
    llm = LLM(args.model, device="cuda", dtype="bfloat16", max_batch_size=32)
    clock = time.perf_counter()

    def lap() -> float:
        nonlocal clock
        sync()
        before, clock = clock, time.perf_counter()
        return clock - before

    cache = llm.runner.allocate_cache(with_hidden=True)
    print(f"KV cache: {lap():.1f} s ({cache.num_rows} rows)", flush=True)
    warmup.compile_kernels(llm.model, cache, routed=True)
    compiles = COUNTERS.snapshot()["compiles"]
    print(f"kernel variants: {lap():.1f} s ({compiles.count} compiled or loaded, {compiles.seconds:.1f} s)", flush=True)

    # each warm-up `generate` call (warm_up_requests' own loop) timed, its steps counted, and where it compiled
    step_of_call = [0]
    step_batch = llm.engine.step_batch

    def counted_step_batch(turn):
        step_of_call[0] += 1
        return step_batch(turn)

    llm.engine.step_batch = counted_step_batch
    compile_steps: list[tuple[int, str]] = []
    record = COUNTERS.record

    def located_record(kind, seconds, name=""):
        if kind == "compiles":
            compile_steps.append((step_of_call[0], name))
        return record(kind, seconds, name)

    COUNTERS.record = located_record
    generate = llm.generate
    groups = defaultdict(lambda: dict(seconds=0.0, calls=0, requests=0, steps=0, compiles=0, last_step=0,
                                      names=set()))
    current = [None]

    def timed_generate(prompts, params, **kwargs):
        sync()
        start, step_of_call[0] = time.perf_counter(), 0
        compile_steps.clear()
        out = generate(prompts, params, **kwargs)
        sync()
        group = groups[(params.method, params.kv_routing or "dense")]
        group["seconds"] += time.perf_counter() - start
        group["calls"] += 1
        group["requests"] += len(prompts)
        group["steps"] += step_of_call[0]
        group["compiles"] += len(compile_steps)
        group["last_step"] = max([group["last_step"], *(s for s, _ in compile_steps)])
        group["names"].update(n for _, n in compile_steps)
        if compile_steps:
            print(f"  {params.method} {params.kv_routing} batch {len(prompts)} x {len(prompts[0])}: "
                  f"compiles at steps {sorted({s for s, _ in compile_steps})} of {step_of_call[0]}: "
                  f"{sorted({n for _, n in compile_steps})}", flush=True)
        return out

    llm.generate = timed_generate
    ran = warmup.warm_up_requests(llm)
    requests_s = lap()
    print(f"warm-up requests: {requests_s:.1f} s ({ran} requests)", flush=True)
    llm.generate = generate
    from flash_dllm.decoding.registry import METHODS
    graphs = warmup.capture_steady_passes(llm, tuple(METHODS))
    print(f"steady-pass graphs: {lap():.1f} s ({graphs} graphs)", flush=True)

    rows = [(method, routing, g["calls"], g["requests"], g["steps"], f"{g['seconds']:.2f}",
             f"{1e3 * g['seconds'] / max(g['steps'], 1):.1f}", g["compiles"], g["last_step"],
             " ".join(sorted(g["names"])))
            for (method, routing), g in groups.items()]
    print(markdown_table(["method", "routing", "calls", "requests", "steps", "seconds", "ms/step", "compiles",
                          "last compile step", "kernels"], rows))


if __name__ == "__main__":
    main()
