"""Where equal requests' latency spreads in a one-key mix: `bench mix`'s offline run (serve's warm-up first), with
every request's shape, arrival, end-to-end time and steps, and every engine step's seconds, shape and rows (which
requests it advanced), written to a JSON file for `--analyse` to break down.

    python benchmarks/mix_trace.py --rate 1.4 --requests 150 --arrivals even --out $OUT/mix_trace.json
    python benchmarks/mix_trace.py --analyse $OUT/mix_trace.json
"""
from __future__ import annotations

import argparse
import json
import statistics

from flash_dllm.engine.counters import percentile

SINGLE = dict(methods=("flash-cache",), max_tokens=(128,), routings=(None, "chunk"))  # h200_mix.sh's SINGLE


def record(args):
    from flash_dllm.bench.mix import MixSpec, run_offline, warm_up
    from flash_dllm.llm import LLM

    spec = MixSpec(num_requests=args.requests, rate=args.rate, arrivals=args.arrivals,
                   prompt_lengths=tuple(args.prompt_lengths), **SINGLE)
    llm = LLM(args.model, max_batch_size=32)
    warm_up(llm, spec)
    engine, trace = llm.engine, []
    first_id = next(engine._request_ids)  # the mix's requests get the ids after it, in arrival order
    step = engine.step

    def traced_step():
        finished = step()
        if engine.current is not None:
            trace.append([seq.request_id - first_id - 1 for seq in engine.current.running])
        return finished
    engine.step = traced_step
    result = run_offline(llm, spec)
    answers = [dict(index=a.request.index, shape=list(a.request.shape), arrival_s=a.request.arrival_s,
                    ttft_s=a.ttft_s, e2e_s=a.e2e_s, tokens=a.tokens) for a in result.answers]
    steps = [dict(seconds=seconds, shape=list(shape), rows=rows) for (seconds, shape), rows in zip(result.steps, trace)]
    json.dump(dict(rate=args.rate, arrivals=args.arrivals, answers=answers, steps=steps), open(args.out, "w"))
    print(f"wrote {args.out}: {len(answers)} requests, {len(steps)} steps")


def analyse(path):
    """Per shape: p50/p99 of end-to-end time, and of its parts: the steps that advanced the request (own steps),
    the other batches' steps while it ran, and the time before its first step."""
    data = json.load(open(path))
    answers = {a["index"]: a for a in data["answers"]}
    own = {i: [0, 0.0] for i in answers}  # steps, seconds
    clock, first, last = 0.0, {}, {}
    for step in data["steps"]:
        clock += step["seconds"]
        for i in step["rows"]:
            if i in own:
                own[i][0] += 1
                own[i][1] += step["seconds"]
                first.setdefault(i, clock - step["seconds"])
                last[i] = clock
    by_shape: dict[tuple, list] = {}
    for i, a in answers.items():
        by_shape.setdefault(tuple(a["shape"]), []).append(i)
    print("| shape | n | e2e p50/p99 s | own steps p50/p99 | own-step s p50/p99 | ms per own step p50/p99 |")
    print("|---|---|---|---|---|---|")
    for shape, ids in sorted(by_shape.items()):
        e2e = [answers[i]["e2e_s"] for i in ids]
        n_steps = [own[i][0] for i in ids]
        own_s = [own[i][1] for i in ids]
        per = [1e3 * own[i][1] / max(own[i][0], 1) for i in ids]
        q = lambda v: f"{percentile(v, 0.5):.2f}/{percentile(v, 0.99):.2f}"
        print(f"| {shape} | {len(ids)} | {q(e2e)} | {q(n_steps)} | {q(own_s)} | {q(per)} |")
    times: dict[tuple, list] = {}
    for step in data["steps"]:
        times.setdefault(tuple(step["shape"]), []).append(step["seconds"])
    print("\n| step shape | n | median ms | max ms |\n|---|---|---|---|")
    for shape, values in sorted(times.items()):
        print(f"| {shape} | {len(values)} | {1e3 * statistics.median(values):.1f} | {1e3 * max(values):.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:llada-8b")
    parser.add_argument("--rate", type=float, default=1.4)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 256, 1024, 3968])
    parser.add_argument("--arrivals", choices=["poisson", "even"], default="even")
    parser.add_argument("--out", default="mix_trace.json")
    parser.add_argument("--analyse", help="a trace file to break down instead of running")
    args = parser.parse_args()
    analyse(args.analyse) if args.analyse else record(args)


if __name__ == "__main__":
    main()
