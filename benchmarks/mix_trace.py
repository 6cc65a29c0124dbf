"""Where equal requests' latency spreads in a one-key mix: `bench mix`'s offline run (serve's warm-up first), with
every request's shape, arrival, end-to-end time and steps, and every engine step's seconds, shape and rows (which
requests it advanced), and what else happened in it (Python collections of any generation and their time; the CUDA
caching allocator's cudaMalloc/cudaFree calls and its retries after freeing its cache, each a device sync), written to
a JSON file for `--analyse` to break down.

    python benchmarks/mix_trace.py --rate 1.4 --requests 150 --arrivals even poisson --out '$OUT/trace_{arrivals}.json'
    python benchmarks/mix_trace.py --analyse $OUT/trace_even.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from flash_dllm.engine.counters import percentile, work_class

ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
SINGLE = dict(methods=("flash-cache",), max_tokens=(128,), routings=(None, "chunk"))  # h200_mix.sh's SINGLE


def record(args):
    from flash_dllm.bench.mix import MixSpec, warm_up
    from flash_dllm.llm import LLM

    llm = LLM(args.model, max_batch_size=32)
    for arrivals in args.arrivals:  # one model, each pattern after the previous one's mix
        spec = MixSpec(num_requests=args.requests, rate=args.rate, arrivals=arrivals,
                       prompt_lengths=tuple(args.prompt_lengths), **SINGLE)
        warm_up(llm, spec)
        out = args.out.replace("{arrivals}", arrivals)
        trace_mix(llm, spec, out)
        print(f"wrote {out}")


def trace_mix(llm, spec, out):
    import torch

    from flash_dllm.bench.mix import mix_requests, run_offline

    engine, trace = llm.engine, []
    requests = mix_requests(spec, llm.config.vocab_size)  # in arrival order: the order run_offline adds them
    index_of, add_request, step = {}, engine.add_request, engine.step
    arriving = iter(requests)  # each add_request call is the next request's, also one that fails

    def traced_add_request(*args, **kwargs):
        index = next(arriving).index
        seq = add_request(*args, **kwargs)
        index_of[seq] = index
        return seq
    collections, started = [], [0.0]  # (generation, seconds) of every collection; when the current one started

    def on_collection(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started[0]))
    gc.callbacks.append(on_collection)

    def allocator() -> dict[str, int]:
        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        return {key: stats.get(key, 0) for key in ALLOCATOR_EVENTS}

    def computed(seq) -> int:  # the query rows the sequence's passes have computed so far
        return seq.row.query_rows if seq.row is not None else seq.query_rows

    def traced_step():
        before = {seq: computed(seq) for seq in engine.running}
        events, seen = allocator(), len(collections)
        finished = step()
        if engine.current is not None:
            rows = engine.current.running
            work = sum(computed(seq) - before.get(seq, 0) for seq in rows)
            after = allocator()
            trace.append(dict(rows=[index_of[seq] for seq in rows], query_rows=work,
                              collections=collections[seen:],
                              allocator={key: after[key] - events[key] for key in after if after[key] != events[key]}))
        return finished
    engine.step, engine.add_request = traced_step, traced_add_request
    try:
        result = run_offline(llm, spec, requests)
    finally:
        engine.step, engine.add_request = step, add_request
        gc.callbacks.remove(on_collection)
    answers = [dict(index=a.request.index, shape=list(a.request.shape), arrival_s=a.request.arrival_s,
                    ttft_s=a.ttft_s, e2e_s=a.e2e_s, tokens=a.tokens) for a in result.answers if a.ok]
    for a in result.answers:
        if not a.ok:
            print(f"request {a.request.index} failed: {a.error}")
    steps = [dict(seconds=seconds, shape=list(shape), **traced) for (seconds, shape), traced in zip(result.steps, trace)]
    json.dump(dict(rate=spec.rate, arrivals=spec.arrivals, answers=answers, steps=steps), open(out, "w"))


def analyse(path):
    """Per shape: p50/p99 of end-to-end time, of the steps that advanced the request (own steps) and of their
    time; then the fit of step time (`fit_step_times`), the slowest requests, 10-s windows and the worst steps."""
    data = json.load(open(path))
    answers = {a["index"]: a for a in data["answers"]}
    own = {i: [0, 0.0] for i in answers}  # steps, seconds
    for step in data["steps"]:
        for i in step["rows"]:
            if i in own:
                own[i][0] += 1
                own[i][1] += step["seconds"]
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
    predicted = fit_step_times(data, answers)
    shape_p50 = {shape: percentile([answers[i]["e2e_s"] for i in ids], 0.5) for shape, ids in by_shape.items()}
    print("\nthe slowest requests against their shape's p50: own steps' batch size and time, and the fit's time")
    print("| request | shape | arrival s | e2e / shape p50 | own steps | mean batch | mean routed rows | ms per own step "
          "| fit ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    slowest = sorted(answers, key=lambda i: -answers[i]["e2e_s"] / shape_p50[tuple(answers[i]["shape"])])[:10]
    for i in slowest:
        mine = [k for k, step in enumerate(data["steps"]) if i in step["rows"]]
        batch = statistics.mean(len(data["steps"][k]["rows"]) for k in mine)
        routed = statistics.mean(data["steps"][k]["shape"][3] for k in mine)
        fit = statistics.mean(predicted[k] for k in mine)
        a = answers[i]
        print(f"| {i} | {a['shape'][1]} {a['shape'][2]} | {a['arrival_s']:.1f} | "
              f"{a['e2e_s'] / shape_p50[tuple(a['shape'])]:.2f} | {len(mine)} | {batch:.1f} | {routed:.1f} | "
              f"{1e3 * own[i][1] / max(own[i][0], 1):.1f} | {1e3 * fit:.1f} |")
    print("\nthe run in windows of 10 s of steps: measured against fitted step time")
    print("| window | steps | mean batch | mean routed rows | mean step ms | fitted ms |\n|---|---|---|---|---|---|")
    clock, window = 0.0, []
    for k, step in enumerate(data["steps"]):
        window.append(k)
        clock += step["seconds"]
        if clock >= 10 or k == len(data["steps"]) - 1:
            steps = [data["steps"][j] for j in window]
            print(f"| {window[0]}-{window[-1]} | {len(window)} | {statistics.mean(len(s['rows']) for s in steps):.1f} | "
                  f"{statistics.mean(s['shape'][3] for s in steps):.1f} | "
                  f"{1e3 * statistics.mean(s['seconds'] for s in steps):.1f} | "
                  f"{1e3 * statistics.mean(predicted[j] for j in window):.1f} |")
            clock, window = 0.0, []
    worst_steps(data)
    times: dict[tuple, list] = {}
    for step in data["steps"]:
        times.setdefault(tuple(step["shape"]), []).append(step["seconds"])
    print("\n| step shape | n | median ms | max ms |\n|---|---|---|---|")
    for shape, values in sorted(times.items()):
        print(f"| {shape} | {len(values)} | {1e3 * statistics.median(values):.1f} | {1e3 * max(values):.1f} |")


def fit_step_times(data, answers):
    """Least squares of each step's seconds on its rows, its routed rows, their prompts' keys, the prompt rows it
    computes for the requests it admits (their first pass) and whether its batch changed (rebuilt): how much of a
    step's time its composition explains. Returns each step's fitted seconds."""
    import torch

    seen, features, seconds, previous = set(), [], [], None
    for step in data["steps"]:
        rows = [i for i in step["rows"] if i in answers]
        new = [i for i in rows if i not in seen]
        seen.update(new)
        prompt = lambda ids: sum(answers[i]["shape"][2] for i in ids) / 1024
        features.append([1.0, len(rows), step["shape"][3], prompt(set(rows) - set(new)), prompt(new),
                         float(rows != previous)])
        seconds.append(step["seconds"])
        previous = rows
    x, y = torch.tensor(features, dtype=torch.float64), torch.tensor(seconds, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(x, y).solution[:, 0]
    residual = (y[:, 0] - x @ coef).abs() / y[:, 0]
    print(f"\nstep s ~ {1e3 * coef[0]:.1f} ms + {1e3 * coef[1]:.2f} ms/row + {1e3 * coef[2]:.2f} ms/routed row + "
          f"{1e3 * coef[3]:.2f} ms per 1k keys of the rows + {1e3 * coef[4]:.1f} ms per 1k prompt tokens admitted + "
          f"{1e3 * coef[5]:.1f} ms where the batch changed ({int(x[:, 5].sum())} of {len(seconds)} steps); "
          f"|residual| p50/p99 "
          f"{percentile(residual.tolist(), 0.5):.2f}/{percentile(residual.tolist(), 0.99):.2f} of the step")
    return (x @ coef).tolist()


def worst_steps(data):
    """The worst step over the median of its shape, per 60 s of steps (the engine's shapes, with the query rows
    classed from the exact rows: a trace from before the quarter-octave classes is classed as today); the ten worst
    steps, and the steps with and without each event."""
    steps, windows, clock, start = data["steps"], [], 0.0, 0
    for k, step in enumerate(steps):
        clock += step["seconds"]
        if clock >= 60 or k == len(steps) - 1:
            windows.append(range(start, k + 1))
            clock, start = 0.0, k + 1
    shape = lambda s: (s["shape"][0], s["shape"][1], work_class(s["query_rows"]), s["shape"][3])
    print("\nworst step / median of its shape, per 60 s of steps\n| steps | worst ratio |\n|---|---|")
    worst = []
    for window in windows:
        by: dict[tuple, list] = {}
        for k in window:
            by.setdefault(shape(steps[k]), []).append(k)
        medians = {key: statistics.median(steps[k]["seconds"] for k in ks) for key, ks in by.items()}
        per_step = {k: steps[k]["seconds"] / medians[key] for key, ks in by.items() for k in ks}
        worst += [(per_step[k], k) for k in window]
        print(f"| {window.start}-{window.stop - 1} | {max(per_step.values()):.2f} |")
    print("\n| step | ratio | ms | batch | query rows | routed | batch changed | collections "
          "(generation: ms) | allocator events |\n|---|---|---|---|---|---|---|---|---|")
    for ratio, k in sorted(worst, reverse=True)[:10]:
        step = steps[k]
        changed = k > 0 and step["rows"] != steps[k - 1]["rows"]
        collected = " ".join(f"{g}: {1e3 * s:.1f}" for g, s in step.get("collections", []))
        print(f"| {k} | {ratio:.2f} | {1e3 * step['seconds']:.1f} | {step['shape'][1]} | {step['query_rows']} | "
              f"{step['shape'][3]} | {changed} | {collected} | {step.get('allocator', {}) or ''} |")
    print("\nsteps with and without each event: how many, and their median ratio to their shape")
    print("| event | steps with | median ratio with | steps without | median ratio without |\n|---|---|---|---|---|")
    ratio_of = {k: ratio for ratio, k in worst}
    events = {"batch changed": lambda k: k > 0 and steps[k]["rows"] != steps[k - 1]["rows"],
              "a collection": lambda k: bool(steps[k].get("collections")),
              "cudaMalloc or cudaFree": lambda k: bool(steps[k].get("allocator"))}
    for name, happened in events.items():
        split = ([ratio_of[k] for k in ratio_of if happened(k)], [ratio_of[k] for k in ratio_of if not happened(k)])
        median = lambda v: f"{statistics.median(v):.2f}" if v else "-"
        print(f"| {name} | {len(split[0])} | {median(split[0])} | {len(split[1])} | {median(split[1])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:llada-8b")
    parser.add_argument("--rate", type=float, default=1.4)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 256, 1024, 3968])
    parser.add_argument("--arrivals", choices=["poisson", "even"], nargs="+", default=["even"],
                        help="one trace each, in turn on one model")
    parser.add_argument("--out", default="mix_trace_{arrivals}.json", help="{arrivals} stands for the pattern")
    parser.add_argument("--analyse", help="a trace file to break down instead of running")
    args = parser.parse_args()
    analyse(args.analyse) if args.analyse else record(args)


if __name__ == "__main__":
    main()
