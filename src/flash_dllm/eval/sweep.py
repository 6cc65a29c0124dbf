"""A grid of decoding methods and knobs on one task: the accuracy / tokens-per-second trade-off as a Pareto
plot (PNG) and a markdown table."""
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
        plot(rows, out_dir / "sweep.png", title=f"{task}: accuracy vs throughput ({rows[0]['num_items']} items)")
    return rows


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", label)


def _by_speed(rows: list[dict]) -> list[dict]:
    """The rows fastest first: the order of the table, whose row numbers label the plot's points."""
    return sorted(rows, key=lambda r: -r["tokens_per_s"])


def sweep_table(rows: list[dict]) -> str:
    header = ("method and knobs", "#", "accuracy %", "tokens/s", "tokens/step", "NFE", "Pareto")
    table = [(row["label"], number, f"{100 * row['accuracy']:.1f}", f"{row['tokens_per_s']:.1f}",
              f"{row['tokens_per_step']:.2f}", f"{row['nfe']:.1f}", "yes" if row["pareto"] else "")
             for number, row in enumerate(_by_speed(rows), 1)]
    return markdown_table(header, table) + "\n"


def plot(rows: list[dict], path: str | Path, title: str):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["tokens_per_s"])
    ax.plot([r["tokens_per_s"] for r in front], [100 * r["accuracy"] for r in front], "-", color="tab:red",
            alpha=0.5, label="Pareto front", zorder=1)
    methods = list(dict.fromkeys(r["label"].split()[0] for r in rows))
    for color, method in zip(plt.get_cmap("tab10").colors, methods):
        mine = [r for r in rows if r["label"].split()[0] == method]
        ax.scatter([r["tokens_per_s"] for r in mine], [100 * r["accuracy"] for r in mine], color=color,
                   label=method, zorder=2)
    # Full labels overlap where points crowd; numbers point to the table (sweep.md), Pareto points get both.
    for number, row in enumerate(_by_speed(rows), 1):
        text = f"{number}: {row['label']}" if row["pareto"] else str(number)
        ax.annotate(text, (row["tokens_per_s"], 100 * row["accuracy"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.set_xlabel("tokens/s")
    ax.set_ylabel("accuracy %")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
