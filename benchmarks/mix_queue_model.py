"""What a stall-free engine would show for a one-key mix (h200_mix.sh PART=steady): the spread that the arrivals
alone leave in equal requests' latency, to read `bench serve --mix`'s worst p99/p50 against.

The model: every request needs `--steps` engine steps; a step over B running requests takes t0 + c * B (fit t0 and
c from `bench mix`'s step table or `mix_trace.py`'s fit: a compute-bound step grows with its rows), plus the keys its
rows attend to (`--per-1k-keys-ms`: the running requests' prompts) and the prompt rows of the requests it admits
(their first pass); at most `--max-batch` run, the rest wait. The requests are the mix's own
(`bench.mix.mix_requests`, same rate, seed, arrivals and shapes), so this is the run's load replayed through an
engine whose steps never stall; its worst shape p99/p50 is the statistic `bench mix` reports. `--kv-rows N`: each
request also needs prompt + max_tokens rows of a KV cache of N rows (the engine's CacheAllocator, oldest waiting
request first); `--no-compaction`: as the engine was before it compacted the cache (a request waits while its rows
are free but split into holes).

`--fit RUN.jsonl ...` (what `bench serve --mix --mix-save` wrote): the step costs (t0, per row, per 1k keys) that
make the model's latencies closest to the run's own, request by request (least squares over a grid), and the run's
worst shape p99/p50 beside the model's: what of the measured spread the load and the mix's make-up explain.

    python benchmarks/mix_queue_model.py --t0-ms 16.1 --per-row-ms 3.61 --per-1k-keys-ms 0.42 --prefill-ms-per-1k 32 \
        --steps 128 --rates 1.2 1.4 1.6 --requests 600 [--kv-rows 34757 [--no-compaction]]
    python benchmarks/mix_queue_model.py --fit steady_requests.jsonl --prefill-ms-per-1k 32 --steps 128 --kv-rows 52136
"""
from __future__ import annotations

import argparse
import itertools
import statistics

from flash_dllm.bench.mix import MixAnswer, MixSpec, load_answers, mix_requests, worst_shape_ratio
from flash_dllm.cache import CacheAllocator
from flash_dllm.engine.counters import percentile
from flash_dllm.markdown import markdown_table


def replay(requests, t0: float, per_row: float, per_prompt_token: float, steps: int, max_batch: int,
           kv_rows: int | None = None, compaction: bool = True, per_key: float = 0.0):
    """(each request's end-to-end seconds, the batch size of each step, each request's wait for admission) through
    the model engine. A request's first step also computes its prompt's rows: `per_prompt_token` seconds each, in
    the step that admits it; every step costs `per_key` seconds per prompt token of the requests it runs.
    kv_rows: the KV cache's rows (None: unbounded)."""
    allocator = CacheAllocator(kv_rows) if kv_rows else None

    def reserve(request) -> int | None:
        length = len(request.prompt_ids) + request.max_tokens
        base = allocator.allocate(length)
        if base is None and compaction and allocator.fits_compacted(length):
            moves = allocator.compact()  # the engine's compact_cache: the running requests' ranges move with it
            for entry in running:
                entry[2] += next((new - old for old, new, rows in moves if old <= entry[2] < old + rows), 0)
            base = allocator.allocate(length)
        return base

    pending, running, waiting, e2e, batches, waits, now = list(requests), [], [], {}, [], {}, 0.0
    while pending or running or waiting:
        while pending and pending[0].arrival_s <= now:
            waiting.append(pending.pop(0))
        step = t0
        while waiting and len(running) < max_batch:
            base = reserve(waiting[0]) if allocator else 0
            if base is None:
                break
            request = waiting.pop(0)
            running.append([request, steps, base])
            waits[request.index] = now - request.arrival_s
            step += per_prompt_token * len(request.prompt_ids)
        if not running:
            now = pending[0].arrival_s
            continue
        batches.append(len(running))
        now += step + per_row * len(running) + per_key * sum(len(entry[0].prompt_ids) for entry in running)
        for entry in running:
            entry[1] -= 1
            if entry[1] == 0:
                e2e[entry[0].index] = now - entry[0].arrival_s
                if allocator:
                    allocator.release(entry[2], len(entry[0].prompt_ids) + entry[0].max_tokens)
        running = [entry for entry in running if entry[1] > 0]
    return [e2e[request.index] for request in requests], batches, [waits[request.index] for request in requests]


def modelled_worst_shape(requests, e2e: list[float]) -> float:
    """`bench mix`'s worst shape p99/p50 of the model's latencies."""
    return worst_shape_ratio([MixAnswer(request, True, e2e_s=seconds) for request, seconds in zip(requests, e2e)])


FIT_GRID = {"t0_ms": [4.0 * i for i in range(1, 7)], "per_row_ms": [1.8 + 0.2 * i for i in range(12)],
            "per_1k_keys_ms": [0.2 * i for i in range(11)]}


def fit(path: str, args) -> tuple:
    """One row of the --fit table: the grid's step costs whose replay of the run's requests is closest to its
    latencies, and what that replay gives against what the run measured."""
    answers = [a for a in load_answers(path) if a.ok]
    requests, measured = [a.request for a in answers], [a.e2e_s for a in answers]
    best = None
    for t0, per_row, per_key in itertools.product(*FIT_GRID.values()):
        e2e, _, _ = replay(requests, t0 / 1e3, per_row / 1e3, args.prefill_ms_per_1k / 1024e3, args.steps,
                           args.max_batch, args.kv_rows, not args.no_compaction, per_key / 1024e3)
        error = statistics.fmean((m - e) ** 2 for m, e in zip(measured, e2e))
        if best is None or error < best[0]:
            best = (error, (t0, per_row, per_key), e2e)
    error, costs, e2e = best
    ratios = [m / e for m, e in zip(measured, e2e)]
    return (path, len(answers), " / ".join(f"{c:g}" for c in costs), f"{error ** 0.5:.2f}",
            f"{percentile(measured, 0.5):.2f} / {percentile(e2e, 0.5):.2f}",
            f"{worst_shape_ratio(answers):.2f} / {modelled_worst_shape(requests, e2e):.2f}",
            "/".join(f"{percentile(ratios, q):.2f}" for q in (0.01, 0.5, 0.99)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", nargs="+", metavar="RUN.jsonl", help="fit the step costs to these runs instead")
    parser.add_argument("--t0-ms", type=float, help="a step's time at no rows (launches, weights)")
    parser.add_argument("--per-row-ms", type=float, help="a step's time per running request")
    parser.add_argument("--prefill-ms-per-1k", type=float, default=0.0,
                        help="a request's first step: its prompt's rows, per 1,024 prompt tokens")
    parser.add_argument("--per-1k-keys-ms", type=float, default=0.0,
                        help="a step's time per 1,024 prompt tokens of the requests it runs (their keys)")
    parser.add_argument("--steps", type=int, required=True, help="engine steps per request")
    parser.add_argument("--rates", type=float, nargs="+", help="requests per second")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 256, 1024, 3968],
                        help="the mix's prompt lengths (h200_mix.sh's SINGLE); its shapes also split dense and chunk")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--kv-rows", type=int, help="the KV cache's rows (default: unbounded)")
    parser.add_argument("--no-compaction", action="store_true", help="a request waits while its free rows are split")
    parser.add_argument("--seed", type=int, default=0, help="the mix's seed (its arrival times and shapes)")
    args = parser.parse_args()
    if args.fit:
        print(markdown_table(("run", "requests", "fitted t0 / per row / per 1k keys ms", "rms error s",
                              "e2e p50 s: run / model", "worst shape p99/p50: run / model",
                              "run / model e2e p1/p50/p99"), [fit(path, args) for path in args.fit]))
        return
    if args.t0_ms is None or args.per_row_ms is None or not args.rates:
        parser.error("--t0-ms, --per-row-ms and --rates are needed without --fit")
    rows = []
    for rate in args.rates:
        for arrivals in ("poisson", "even"):
            spec = MixSpec(num_requests=args.requests, rate=rate, arrivals=arrivals, seed=args.seed,
                           prompt_lengths=tuple(args.prompt_lengths), max_tokens=(128,), methods=("flash-cache",))
            requests = mix_requests(spec)
            e2e, batches, waits = replay(requests, args.t0_ms / 1e3, args.per_row_ms / 1e3,
                                         args.prefill_ms_per_1k / 1024e3, args.steps, args.max_batch, args.kv_rows,
                                         not args.no_compaction, args.per_1k_keys_ms / 1024e3)
            rows.append((f"{rate:g}", arrivals, "/".join(f"{percentile(batches, q):.0f}" for q in (0.1, 0.5, 0.9)),
                         "/".join(f"{percentile(waits, q):.2f}" for q in (0.5, 0.9, 0.99)),
                         f"{percentile(e2e, 0.5):.2f}", f"{percentile(e2e, 0.99) / percentile(e2e, 0.5):.2f}",
                         f"{modelled_worst_shape(requests, e2e):.2f}"))
    print(markdown_table(("requests/s", "arrivals", "running p10/p50/p90", "wait p50/p90/p99 s", "e2e p50 s", "e2e p99/p50",
                          "worst shape p99/p50"), rows))


if __name__ == "__main__":
    main()
