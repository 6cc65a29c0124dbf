"""What capturing the steady passes for more batch sizes before ready buys (`serve --graph-batch-sizes`): one model,
`serve --methods flash-cache`'s warm-up (batch size 1's passes), a dense one-key mix at a load of a few requests, twice
(the second is the baseline: a first mix after start-up may run slower); then the steady passes of `--sizes` captured
as `serve --graph-batch-sizes 1 SIZES` would before ready (their count and seconds: the start-up's cost) and the same
mix again. Each batch size's median steady step, and the mixes' latency.

    python benchmarks/graph_batch_sizes.py --rate 0.8 --requests 16 --sizes 2 3 4
"""
from __future__ import annotations

import argparse
import statistics
import time

from flash_dllm.engine.counters import percentile


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llada-8b")
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 256, 1024, 3968])
    args = parser.parse_args()

    from flash_dllm.bench.mix import MixSpec, run_offline
    from flash_dllm.engine.warmup import before_ready, capture_steady_passes, freeze_heap
    from flash_dllm.llm import LLM

    llm = LLM(args.model, max_batch_size=32)
    # dense only: a routed request's passes never replay a graph
    spec = MixSpec(num_requests=args.requests, rate=args.rate, arrivals="even", methods=("flash-cache",),
                   max_tokens=(128,), routings=(None,), prompt_lengths=tuple(args.prompt_lengths))
    before_ready(llm, methods=("flash-cache",), block_length=spec.block_length)
    graphs = llm.runner.graphs
    if graphs is not None:
        graphs.stop_capturing()
    freeze_heap()
    runs = {"1 only, first mix": run_offline(llm, spec), "1 only": run_offline(llm, spec)}
    start = time.perf_counter()
    if graphs is not None:  # None on the CPU: nothing is captured, both mixes run eagerly
        graphs.capturing = True  # as before ready
    captured = capture_steady_passes(llm, ("flash-cache",), spec.block_length, tuple(args.sizes))
    capture_s = time.perf_counter() - start
    if graphs is not None:
        graphs.stop_capturing()
    runs["with sizes"] = run_offline(llm, spec)

    def medians(result) -> dict[int, tuple[int, float]]:
        """Per batch size, its steady steps' (the most frequent query rows; a first pass computes a prompt's rows)
        count and median seconds."""
        by_shape: dict[tuple[int, int], list[float]] = {}
        for seconds, shape in result.steps:
            by_shape.setdefault((shape.batch_size, shape.query_rows), []).append(seconds)
        out = {}
        for (size, _), times in sorted(by_shape.items(), key=lambda item: len(item[1])):
            out[size] = (len(times), statistics.median(times))  # the most frequent last
        return out

    print(f"# {args.model}: steady passes of flash-cache for batch sizes {args.sizes}: {captured} graphs in "
          f"{capture_s:.1f} s; {args.requests} dense requests at {args.rate}/s, 128 tokens, prompts "
          f"{args.prompt_lengths}")
    m_before, m_after = medians(runs["1 only"]), medians(runs["with sizes"])
    print("| batch size | steps (1 only) | median steady step ms (1 only) | steps (with sizes) | median ms (with "
          "sizes) | ratio |\n|---|---|---|---|---|---|")
    for size in sorted(set(m_before) | set(m_after)):
        (n0, t0), (n1, t1) = m_before.get(size, (0, float("nan"))), m_after.get(size, (0, float("nan")))
        print(f"| {size} | {n0} | {1e3 * t0:.1f} | {n1} | {1e3 * t1:.1f} | {t1 / t0:.2f} |")
    for name, result in runs.items():
        e2e = [a.e2e_s for a in result.answers if a.ok]
        print(f"{name}: e2e p50/p90 {percentile(e2e, 0.5):.2f}/{percentile(e2e, 0.9):.2f} s, "
              f"{sum(a.tokens for a in result.answers) / result.wall_s:.1f} tokens/s, captures after ready "
              f"{result.captures[0]}")


if __name__ == "__main__":
    main()
