"""What a stall-free engine would show for a one-key mix (h200_mix.sh PART=steady): the spread that the arrivals
alone leave in equal requests' latency, to read `bench serve --mix`'s worst p99/p50 against.

The model: every request needs `--steps` engine steps; a step over B running requests takes t0 + c * B (fit t0 and
c from `bench mix`'s step table: a compute-bound step grows with its rows), plus the prompt rows of the requests it
admits (their first pass); at most `--max-batch` run, the rest wait. The requests are the mix's own
(`bench.mix.mix_requests`, same rate, seed, arrivals and shapes), so this is the run's load replayed through an
engine whose steps never stall; its worst shape p99/p50 is the statistic `bench mix` reports.

    python benchmarks/mix_queue_model.py --t0-ms 20 --per-row-ms 3.5 --prefill-ms-per-1k 28 --steps 130 --rates 1.2 1.4 1.6 \
        --requests 600
"""
from __future__ import annotations

import argparse

from flash_dllm.bench.mix import MixSpec, mix_requests
from flash_dllm.engine.counters import percentile
from flash_dllm.markdown import markdown_table


def replay(requests, t0: float, per_row: float, per_prompt_token: float, steps: int, max_batch: int):
    """(each request's end-to-end seconds, the batch size of each step) through the model engine. A request's first
    step also computes its prompt's rows: `per_prompt_token` seconds each, in the step that admits it."""
    pending, running, waiting, e2e, batches, now = list(requests), [], [], {}, [], 0.0
    while pending or running or waiting:
        while pending and pending[0].arrival_s <= now:
            waiting.append(pending.pop(0))
        step = t0
        while waiting and len(running) < max_batch:
            request = waiting.pop(0)
            running.append([request, steps])
            step += per_prompt_token * len(request.prompt_ids)
        if not running:
            now = pending[0].arrival_s
            continue
        batches.append(len(running))
        now += step + per_row * len(running)
        for entry in running:
            entry[1] -= 1
        e2e.update({request.index: now - request.arrival_s for request, left in running if left == 0})
        running = [entry for entry in running if entry[1] > 0]
    return [e2e[request.index] for request in requests], batches


def worst_shape_ratio(requests, e2e) -> float:
    """`bench mix`'s statistic: the largest p99/p50 of end-to-end latency over the mix's shapes."""
    by_shape: dict[tuple, list[float]] = {}
    for request, seconds in zip(requests, e2e):
        by_shape.setdefault(request.shape, []).append(seconds)
    return max(percentile(v, 0.99) / percentile(v, 0.5) for v in by_shape.values() if len(v) >= 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--t0-ms", type=float, required=True, help="a step's time at no rows (launches, weights)")
    parser.add_argument("--per-row-ms", type=float, required=True, help="a step's time per running request")
    parser.add_argument("--prefill-ms-per-1k", type=float, default=0.0,
                        help="a request's first step: its prompt's rows, per 1,024 prompt tokens")
    parser.add_argument("--steps", type=int, required=True, help="engine steps per request")
    parser.add_argument("--rates", type=float, nargs="+", required=True, help="requests per second")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 256, 1024, 3968],
                        help="the mix's prompt lengths (h200_mix.sh's SINGLE); its shapes also split dense and chunk")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the mix's seed (its arrival times and shapes)")
    args = parser.parse_args()
    rows = []
    for rate in args.rates:
        for arrivals in ("poisson", "even"):
            spec = MixSpec(num_requests=args.requests, rate=rate, arrivals=arrivals, seed=args.seed,
                           prompt_lengths=tuple(args.prompt_lengths), max_tokens=(128,), methods=("flash-cache",))
            requests = mix_requests(spec)
            e2e, batches = replay(requests, args.t0_ms / 1e3, args.per_row_ms / 1e3, args.prefill_ms_per_1k / 1024e3,
                                  args.steps, args.max_batch)
            rows.append((f"{rate:g}", arrivals, "/".join(f"{percentile(batches, q):.0f}" for q in (0.1, 0.5, 0.9)),
                         f"{percentile(e2e, 0.5):.2f}", f"{percentile(e2e, 0.99) / percentile(e2e, 0.5):.2f}",
                         f"{worst_shape_ratio(requests, e2e):.2f}"))
    print(markdown_table(("requests/s", "arrivals", "running p10/p50/p90", "e2e p50 s", "e2e p99/p50",
                          "worst shape p99/p50"), rows))


if __name__ == "__main__":
    main()
