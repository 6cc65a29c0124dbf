"""A grid of decoding methods and knobs on one task: accuracy against tokens per step (what a method decodes per
forward, the same on any device) and against tokens per second (this device's), each point with its 95% interval,
as a plot (PNG) and a markdown table; the Pareto front is by tokens per second."""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..extras import require_extra
from ..markdown import markdown_table
from ..sampling_params import SamplingParams, knobs
from .distributed import DistContext
from .harness import evaluate, write_result


@dataclass(frozen=True)
class SweepPoint:
    label: str
    params: SamplingParams


def grid(methods: list[str], knob_values: dict[str, list], **common) -> list[SweepPoint]:
    """Each method with every combination of the given knob values that it reads (a knob that a method does
    not read is not varied for it); `threshold` and `factor` are alternative forms of one acceptance rule,
    so their values form a single axis. `common` (max_tokens, block_length, ...) goes to every point."""
    points, known = [], knobs()
    for method in methods:
        reads = {name: values for name, values in knob_values.items() if values and method in known[name].defaults}
        rule = [("threshold", v) for v in reads.pop("threshold", [])] + [("factor", v) for v in reads.pop("factor", [])]
        axes = ([rule] if rule else []) + [[(name, v) for v in values] for name, values in reads.items()]
        for combo in itertools.product(*axes):
            label = " ".join([method] + [f"{known[name].symbol or name}={value}" for name, value in combo])
            points.append(SweepPoint(label, SamplingParams(method=method, **common, **dict(combo))))
    return points


def pareto_front(rows: list[dict]) -> list[bool]:
    """Whether each row is on the front: no other row is at least as accurate and as fast, and better in one."""
    def dominates(a, b):
        return (a["accuracy"] >= b["accuracy"] and a["tokens_per_s"] >= b["tokens_per_s"]
                and (a["accuracy"] > b["accuracy"] or a["tokens_per_s"] > b["tokens_per_s"]))
    return [not any(dominates(other, row) for other in rows) for row in rows]


def run_sweep(llm, task: str, points: list[SweepPoint], out_dir: str | Path, *, data: str | None = None,
              limit: int | None = None, ctx: DistContext = DistContext(), progress: bool = True,
              length: int | None = None) -> list[dict]:
    """Evaluate every point on the same items (length: a retrieval task's items of that prompt length); rank 0
    writes each point's results, the table and the plot."""
    require_extra("eval", "the sweep's plot", "matplotlib")  # drawn at the end: missing, say so before the work
    out_dir = Path(out_dir)
    rows = []
    for number, point in enumerate(points):
        result = evaluate(llm, task, point.params, data=data, limit=limit, ctx=ctx, progress=progress, length=length)
        rows.append({"label": point.label, **result.summary})
        if ctx.is_main:
            write_result(result, out_dir / "points" / f"{number:02d}-{_slug(point.label)}.jsonl")
    for row, on_front in zip(rows, pareto_front(rows)):
        row["pareto"] = on_front
    if ctx.is_main:
        (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
        (out_dir / "sweep.md").write_text(sweep_table(rows))
        plot(rows, out_dir / "sweep.png", title=f"{task}: accuracy vs parallelism and throughput "
                                                f"({rows[0]['num_items']} items, 95% intervals)")
    return rows


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", label)


def _by_speed(rows: list[dict]) -> list[dict]:
    """The rows fastest first: the order of the table, whose row numbers label the plot's points."""
    return sorted(rows, key=lambda r: -r["tokens_per_s"])


def sweep_table(rows: list[dict]) -> str:
    header = ("method and knobs", "#", "accuracy %", "95% interval", "tokens/s", "tokens/step", "NFE", "Pareto")
    table = [(row["label"], number, f"{100 * row['accuracy']:.1f}",
              "{:.1f}-{:.1f}".format(*(100 * bound for bound in row["accuracy_ci95"])), f"{row['tokens_per_s']:.1f}",
              f"{row['tokens_per_step']:.2f}", f"{row['nfe']:.1f}", "yes" if row["pareto"] else "")
             for number, row in enumerate(_by_speed(rows), 1)]
    return markdown_table(header, table) + "\n"


def plot(rows: list[dict], path: str | Path, title: str):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    methods = list(dict.fromkeys(r["label"].split()[0] for r in rows))
    numbers = {id(row): number for number, row in enumerate(_by_speed(rows), 1)}
    for ax, x, label in zip(axes, ("tokens_per_step", "tokens_per_s"), ("tokens per step", "tokens/s")):
        if x == "tokens_per_s":
            front = sorted((r for r in rows if r["pareto"]), key=lambda r: r[x])
            ax.plot([r[x] for r in front], [100 * r["accuracy"] for r in front], "-", color="tab:red", alpha=0.5,
                    label="Pareto front", zorder=1)
        for color, method in zip(plt.get_cmap("tab10").colors, methods):
            mine = [r for r in rows if r["label"].split()[0] == method]
            accuracy = [100 * r["accuracy"] for r in mine]
            error = [[a - 100 * r["accuracy_ci95"][0] for a, r in zip(accuracy, mine)],
                     [100 * r["accuracy_ci95"][1] - a for a, r in zip(accuracy, mine)]]
            ax.errorbar([r[x] for r in mine], accuracy, yerr=error, fmt="o", color=color, capsize=2,
                        label=method, zorder=2)
        # Full labels overlap where points crowd; numbers point to the table (sweep.md), Pareto points get both.
        for row in rows:
            text = f"{numbers[id(row)]}: {row['label']}" if row["pareto"] else str(numbers[id(row)])
            ax.annotate(text, (row[x], 100 * row["accuracy"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy %")
    axes[1].legend(loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
