"""Flash-Verify's accuracy / tokens-per-iteration trade-off on arith over (beta_t, gamma), against
parallel and flash-cache at the same threshold, on the embedded model.

    python benchmarks/archive/sweep_flash_verify.py --items 100 --device cpu --out benchmarks/archive/sweep_flash_verify
writes OUT.md (table) and OUT.png (plot).
"""
import argparse
import time
from pathlib import Path

from flash_dllm import LLM, SamplingParams
from flash_dllm.markdown import markdown_table
from flash_dllm.tasks import is_correct, load_test_set


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--device", default=None)
    parser.add_argument("--tracking-budgets", type=int, nargs="+", default=[16, 48, 80])
    parser.add_argument("--gammas", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/archive/sweep_flash_verify"))
    args = parser.parse_args()
    llm = LLM(device=args.device)
    items = load_test_set("arith")[:args.items]
    prompts = [item.prompt for item in items]
    runs = [("parallel", None, None, dict(method="parallel"))]
    runs += [("flash-cache", beta_t, None, dict(method="flash-cache", tracking_budget=beta_t))
             for beta_t in args.tracking_budgets]
    runs += [("flash-verify", beta_t, gamma,
              dict(method="flash-verify", tracking_budget=beta_t, verify_threshold=gamma))
             for beta_t in args.tracking_budgets for gamma in args.gammas]
    rows, points = [], []
    for label, beta_t, gamma, kwargs in runs:
        params = SamplingParams(max_tokens=128, block_length=32, threshold=0.9, **kwargs)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        accuracy = 100 * sum(is_correct(i, o.text) for i, o in zip(items, outs)) / len(items)
        steps = sum(o.steps for o in outs)
        per_iteration = sum(len(o.token_ids) for o in outs) / steps
        rows.append((label, beta_t or "-", gamma or "-", f"{accuracy:.1f}", f"{per_iteration:.2f}",
                     f"{sum(o.nfe for o in outs) / len(outs):.1f}", f"{sum(o.query_rows for o in outs) / steps:.0f}",
                     f"{sum(len(o.token_ids) for o in outs) / wall:.0f}"))
        points.append((label, beta_t, gamma, accuracy, per_iteration))
        print(" | ".join(map(str, rows[-1])), flush=True)
    table = markdown_table(("method", "beta_t", "gamma", "accuracy %", "tokens/iteration", "NFE",
                            "query rows/iteration", "tokens/s"), rows)
    args.out.with_suffix(".md").write_text(f"arith, {len(items)} held-out items, gen 128, block 32, eps 0.9, "
                                           f"device {llm.device}\n\n{table}\n")
    print(table)
    plot(points, args.out.with_suffix(".png"), len(items))


def plot(points, path: Path, num_items: int):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, marker in (("parallel", "s"), ("flash-cache", "^"), ("flash-verify", "o")):
        chosen = [p for p in points if p[0] == label]
        ax.scatter([p[4] for p in chosen], [p[3] for p in chosen], marker=marker, label=label, s=45)
        for _, beta_t, gamma, accuracy, per_iteration in chosen:
            text = "" if beta_t is None else f"bt={beta_t}" + ("" if gamma is None else f", g={gamma}")
            ax.annotate(text, (per_iteration, accuracy), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("tokens per iteration")
    ax.set_ylabel(f"arith accuracy (%), {num_items} held-out items")
    ax.set_title("Flash-Verify trade-off on the embedded model (eps 0.9, block 32, gen 128)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
