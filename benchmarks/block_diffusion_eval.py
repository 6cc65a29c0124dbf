"""Accuracy, tokens per step and speed of the block-diffusion methods on a trained block-causal model (the tiny
LLaDA2 model of training/train_llada2.py) over the embedded tasks' held-out items, at three threshold settings each.

    python benchmarks/block_diffusion_eval.py --model DIR [--items 100] [--device cuda]

Rows: `parallel` (LLaDA2.0's sampler) at threshold 0.95 (published), 0.8 and 0.6; `edit` (Draft-and-Edit) at its
published defaults 0.95 / 0.9 and the model cards' quality (0.7 / 0.5) and speed (0.5 / 0.0) modes; `flash-cache`
inside the block (threshold 0.95, 8 + 8 rows a step). One warm-up call per row; tokens/s over the timed call.
"""
from __future__ import annotations

import argparse

from flash_dllm import LLM, SamplingParams
from flash_dllm.eval.embedded import run_task
from flash_dllm.markdown import markdown_table
from flash_dllm.tasks import answer_length, load_test_set

ROWS = {
    "parallel 0.95": dict(method="parallel", threshold=0.95),
    "parallel 0.8": dict(method="parallel", threshold=0.8),
    "parallel 0.6": dict(method="parallel", threshold=0.6),
    "edit 0.95/0.9": dict(method="edit", threshold=0.95, edit_threshold=0.9),
    "edit 0.7/0.5": dict(method="edit", threshold=0.7, edit_threshold=0.5),
    "edit 0.5/0.0": dict(method="edit", threshold=0.5, edit_threshold=0.0),
    "flash-cache 0.95 (8+8)": dict(method="flash-cache", threshold=0.95, mask_window=8, tracking_budget=8),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--tasks", nargs="+", default=["arith", "trace"])
    parser.add_argument("--device")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_batch_size=args.items)
    items = {task: load_test_set(task)[:args.items] for task in args.tasks}
    table = []
    for label, settings in ROWS.items():
        results = []
        for task in args.tasks:
            params = SamplingParams(max_tokens=answer_length(task), **settings)
            llm.generate([items[task][0].prompt], params, use_tqdm=False)  # warm-up: compiles, graphs
            results.append(run_task(llm, task, label, items[task], params))
        tokens, steps = sum(r.tokens for r in results), max(1, sum(r.steps for r in results))
        table.append((label, *(f"{r.accuracy:.0%}" for r in results),
                      f"{sum(r.nfe for r in results) / sum(r.num_items for r in results):.1f}", f"{tokens / steps:.2f}",
                      f"{sum(r.query_rows for r in results) / steps:.0f}",
                      f"{tokens / sum(r.wall_s for r in results):.0f}"))
    print(f"# {args.model} on {llm.device}, {args.items} held-out items per task, batch {args.items}")
    print(markdown_table(("method", *args.tasks, "NFE/item", "tokens/step", "query rows/step", "tok/s"), table))


if __name__ == "__main__":
    main()
