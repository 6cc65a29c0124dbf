"""Retrieval (passkey, multikey) of the embedded model with the prompt's KV routed (cache/routing.py), at equal
budgets: each policy and dense attention on the held-out items of the given lengths, with 95% Wilson intervals and
the fraction of the prompt's KV read. Dual-cache at threshold 1 (one token per step) so that every answer token
after the first comes from a step that reads the prompt through the routing (a full pass reads it densely).

    PYTHONPATH=src python benchmarks/routing_retrieval.py --task passkey multikey --lengths 2048 4096 8000 --items 100
"""
from __future__ import annotations

import argparse

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache.routing import POLICIES
from flash_dllm.eval.harness import wilson_interval
from flash_dllm.markdown import markdown_table
from flash_dllm.tasks import RETRIEVAL_TASKS, answer_length, is_correct, load_test_set


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", nargs="+", default=["passkey"], choices=RETRIEVAL_TASKS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--skip", type=int, default=0, help="items passed over first (to extend an earlier run)")
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--method", default="dual-cache")
    ap.add_argument("--policies", nargs="+", default=["dense", *POLICIES], choices=["dense", *POLICIES])
    ap.add_argument("--model", help="a checkpoint directory (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    rows = []
    for task, length in ((task, length) for task in args.task for length in args.lengths):
        items = [item for item in load_test_set(task) if item.length == length][args.skip:args.skip + args.items]
        for policy in (None if name == "dense" else name for name in args.policies):
            params = SamplingParams(method=args.method, max_tokens=answer_length(task), block_length=32,
                                    threshold=1.0, kv_routing=policy, kv_budget=args.budget)
            outputs = llm.generate([item.prompt for item in items], params, use_tqdm=False)
            correct = sum(is_correct(item, out.text or "") for item, out in zip(items, outputs))
            low, high = wilson_interval(correct, len(items))
            read = [out.prompt_kv_read for out in outputs if out.prompt_kv_read is not None]
            rows.append((task, length, policy or "dense", len(items), f"{100 * correct / len(items):.1f}",
                         f"{100 * low:.1f}-{100 * high:.1f}", f"{sum(read) / len(read):.3f}" if read else "1"))
            print(" | ".join(map(str, rows[-1])), flush=True)
    print(markdown_table(("task", "prompt tokens", "routing", "items", "retrieved %", "95% interval",
                          "prompt KV read"), rows))


if __name__ == "__main__":
    main()
