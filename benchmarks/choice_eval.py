"""Issue 57's claims on a model trained on the choice tasks (pairs, perm, pick): accuracy (with its 95% interval)
and tokens per step of fixed-k parallel decoding, threshold decoding and Flash-Verify on each choice task, and the
old tasks' accuracy beside a baseline model's (the model before that training).

    python benchmarks/choice_eval.py --model DIR [--baseline DIR] [--items 200] [--device cuda]

Rows: `k=1..8`: the reference sampler with max_tokens / k steps (k tokens a step, the most confident first);
`threshold T`: parallel decoding at threshold T; `flash-verify`: Flash-Verify at its defaults. Old tasks: arith and
trace at k=1 and threshold 0.9 for both models. One warm-up call per row.
"""
from __future__ import annotations

import argparse

from flash_dllm import LLM, SamplingParams
from flash_dllm.eval.embedded import run_task
from flash_dllm.eval.harness import wilson_interval
from flash_dllm.markdown import markdown_table
from flash_dllm.tasks import CHOICE_TASKS, answer_length, load_test_set


def rows(task: str) -> dict[str, dict]:
    length = answer_length(task)
    fixed = {f"k={k}": dict(method="reference", steps=length // k) for k in (1, 2, 4, 8)}
    return {**fixed, "threshold 0.9": dict(method="parallel", threshold=0.9),
            "threshold 0.7": dict(method="parallel", threshold=0.7), "flash-verify": dict(method="flash-verify")}


def measure(llm, task: str, label: str, items, settings: dict) -> list[str]:
    params = SamplingParams(max_tokens=answer_length(task), **settings)
    llm.generate([items[0].prompt], params, use_tqdm=False)  # warm-up: compiles, graphs
    result = run_task(llm, task, label, items, params)
    low, high = wilson_interval(result.num_correct, result.num_items)
    return [f"{result.accuracy:.1%}", f"{low:.0%}-{high:.0%}", f"{result.tokens_per_step:.2f}",
            f"{result.tokens / result.wall_s:.0f}"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--baseline", help="the model before the choice tasks' training: its old-task accuracy")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--device")
    args = parser.parse_args()
    header = ("accuracy", "95% interval", "tokens/step", "tok/s")
    llm = LLM(args.model, device=args.device, max_batch_size=args.items)
    table = []
    for task in CHOICE_TASKS:
        items = load_test_set(task)[:args.items]
        table += [(task, label, *measure(llm, task, label, items, settings)) for label, settings in rows(task).items()]
    print(f"# {args.model} on {llm.device}, {args.items} held-out items per task, batch {args.items}")
    print(markdown_table(("task", "method", *header), table))
    old = [(args.model, llm)] + ([(args.baseline, LLM(args.baseline, device=args.device, max_batch_size=args.items))]
                                 if args.baseline else [])
    table = []
    for name, model in old:
        for task in ("arith", "trace"):
            items = load_test_set(task)[:args.items]
            for label in ("k=1", "threshold 0.9"):
                table.append((name, task, label, *measure(model, task, label, items, rows(task)[label])))
    print(markdown_table(("model", "task", "method", *header), table))


if __name__ == "__main__":
    main()
