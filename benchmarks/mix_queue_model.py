"""What a stall-free engine would show for a one-key mix (h200_mix.sh PART=steady): the spread that the arrivals
alone leave in equal requests' latency, to read `bench serve --mix`'s worst p99/p50 against.

The model: every request needs `--steps` engine steps; a step over B running requests takes t0 + c * B (fit t0 and
c from `bench mix`'s step table: a compute-bound step grows with its rows); at most `--max-batch` run, the rest
wait. The arrival times are the mix's own (`bench.mix.mix_requests`, same rate, seed and arrivals), so this is the
run's load replayed through an engine whose steps never stall.

    python benchmarks/mix_queue_model.py --t0-ms 20 --per-row-ms 3.5 --steps 130 --rates 1.2 1.4 1.6 --requests 600
"""
from __future__ import annotations

import argparse

from flash_dllm.bench.mix import MixSpec, mix_requests
from flash_dllm.engine.counters import percentile
from flash_dllm.markdown import markdown_table


def replay(arrivals: list[float], t0: float, per_row: float, steps: int, max_batch: int):
    """(each request's end-to-end seconds, the batch size of each step) through the model engine."""
    pending, running, waiting, e2e, batches, now = list(arrivals), [], [], [], [], 0.0
    while pending or running or waiting:
        while pending and pending[0] <= now:
            waiting.append([pending.pop(0), steps])
        while waiting and len(running) < max_batch:
            running.append(waiting.pop(0))
        if not running:
            now = pending[0]
            continue
        batches.append(len(running))
        now += t0 + per_row * len(running)
        for request in running:
            request[1] -= 1
        e2e += [now - arrival for arrival, left in running if left == 0]
        running = [request for request in running if request[1] > 0]
    return e2e, batches


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--t0-ms", type=float, required=True, help="a step's time at no rows (launches, weights)")
    parser.add_argument("--per-row-ms", type=float, required=True, help="a step's time per running request")
    parser.add_argument("--steps", type=int, required=True, help="engine steps per request")
    parser.add_argument("--rates", type=float, nargs="+", required=True, help="requests per second")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the mix's seed (its arrival times)")
    args = parser.parse_args()
    rows = []
    for rate in args.rates:
        for arrivals in ("poisson", "even"):
            spec = MixSpec(num_requests=args.requests, rate=rate, arrivals=arrivals, seed=args.seed,
                           prompt_lengths=(1,), max_tokens=(1,), methods=("flash-cache",), routings=(None,))
            e2e, batches = replay([r.arrival_s for r in mix_requests(spec)], args.t0_ms / 1e3, args.per_row_ms / 1e3,
                                  args.steps, args.max_batch)
            rows.append((f"{rate:g}", arrivals, "/".join(f"{percentile(batches, q):.0f}" for q in (0.1, 0.5, 0.9)),
                         f"{percentile(e2e, 0.5):.2f}", f"{percentile(e2e, 0.99) / percentile(e2e, 0.5):.2f}"))
    print(markdown_table(("requests/s", "arrivals", "running p10/p50/p90", "e2e p50 s", "e2e p99/p50"), rows))


if __name__ == "__main__":
    main()
