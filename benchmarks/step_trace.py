"""What made a served step slow: reads `serve --step-trace`'s file and prints, per minute of steps, the worst ratio
of a step to the median of its shape (as /metrics' step_seconds_max_ratio), measured on the steps' wall time and
on their CPU time (wall minus CPU: what the engine thread waited for, e.g. the GIL while the HTTP front ran Python);
the wait's distribution; and the slowest steps against their shape's median, with what else happened in them.

    python benchmarks/step_trace.py $OUT/steady_steps.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics

from flash_dllm.engine.counters import StepShape, percentile, worst_shape


def shape_of(step: dict) -> StepShape:
    return StepShape(step["method"], step["batch_size"], step["query_rows"], step["routed_rows"])


def worst(steps: list[dict], field: str) -> tuple[int, float, float]:
    """worst_shape over `steps`, each step's time its `field` (seconds or cpu_seconds)."""
    return worst_shape([(step[field], shape_of(step)) for step in steps]) or (0, 0.0, 0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    steps = [json.loads(line) for line in open(args.trace)]
    for step in steps:
        step["waited"] = max(step["seconds"] - step["cpu_seconds"], 0.0)
    print(f"# {args.trace}: {len(steps)} steps over {steps[-1]['t']:.0f} s")

    print("\n| minute | steps | worst ratio, wall (steps of its shape) | worst ratio, CPU time | waited ms p50/p99/max "
          "| collections |\n|---|---|---|---|---|---|")
    windows: dict[int, list[dict]] = {}
    for step in steps:
        windows.setdefault(int(step["t"] // args.window_s), []).append(step)
    for index, window in sorted(windows.items()):
        count, _, wall = worst(window, "seconds")
        _, _, cpu = worst(window, "cpu_seconds")
        waited = [1e3 * step["waited"] for step in window]
        print(f"| {index} | {len(window)} | {wall:.2f} ({count}) | {cpu:.2f} | {percentile(waited, 0.5):.1f}/"
              f"{percentile(waited, 0.99):.1f}/{max(waited):.1f} | {sum(step['collections'] for step in window)} |")

    medians: dict[tuple[int, StepShape], float] = {}
    for index, window in windows.items():
        by_shape: dict[StepShape, list[float]] = {}
        for step in window:
            by_shape.setdefault(shape_of(step), []).append(step["seconds"])
        medians.update({(index, shape): statistics.median(times) for shape, times in by_shape.items()})
    for step in steps:
        step["ratio"] = step["seconds"] / medians[int(step["t"] // args.window_s), shape_of(step)]
    print(f"\nthe {args.top} steps furthest over their shape's median in their minute")
    print("| t s | ratio | ms | CPU ms | waited ms | collections | batch | query rows (class) | routed | running "
          "| waiting | positions |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for step in sorted(steps, key=lambda s: -s["ratio"])[:args.top]:
        print(f"| {step['t']:.1f} | {step['ratio']:.2f} | {1e3 * step['seconds']:.1f} | "
              f"{1e3 * step['cpu_seconds']:.1f} | {1e3 * step['waited']:.1f} | {step['collections']} | "
              f"{step['batch_size']} | {step.get('rows', '-')} ({step['query_rows']}) | {step['routed_rows']} | "
              f"{step['running']} | {step['waiting']} | {step['positions']} |")
    over = [step for step in steps if step["ratio"] > 1.5]
    rest = [step for step in steps if step["ratio"] <= 1.5]
    for name, group in (("over 1.5x", over), ("the rest", rest)):
        if group:
            print(f"{name}: {len(group)} steps, waited ms p50 {percentile([1e3 * s['waited'] for s in group], 0.5):.1f}"
                  f", waited share of wall {sum(s['waited'] for s in group) / sum(s['seconds'] for s in group):.2f}")


if __name__ == "__main__":
    main()
