"""Memory and time of long prompts on the CPU: each cached method decodes N passkey prompts of one length in one
LLM.generate call (the embedded model, fp32), each method in its own process, so that the max RSS is the method's.

    PYTHONPATH=src python benchmarks/cpu_long_prompts.py --num-prompts 10 --prompt-length 8000

The items are the passkey test set's first N of that length (as `flash-dllm eval --task passkey --prompt-length
8000 --limit N` picks them), with the task's generation length. Before the timed call, one prompt of 256 tokens
warms the method up and allocates the KV cache (its bytes are in the max RSS, its time is not). Prints a markdown
table; the max RSS is the process's peak (weights, KV cache, working memory), read with getrusage, and the CPU
seconds (user + system) of the timed call are beside its wall time: on a shared machine the wall time is the noisier.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

METHODS = ("prefix-cache", "dual-cache", "flash-cache", "flash-verify", "elastic")


def passkey_items(count: int, length: int):
    from flash_dllm.tasks import load_test_set

    items = [item for item in load_test_set("passkey") if item.length == length][:count]
    if len(items) < count:
        raise SystemExit(f"the passkey test set has {len(items)} items of {length} tokens, not {count}")
    return items


def run_method(method: str, count: int, length: int) -> dict:
    """In this process: the timed call, its accuracy and this process's max RSS."""
    from flash_dllm import LLM, SamplingParams
    from flash_dllm.tasks import answer_length, is_correct

    items = passkey_items(count, length)
    llm = LLM(device="cpu", dtype="float32")
    params = SamplingParams(method=method, max_tokens=answer_length("passkey"))
    llm.generate([passkey_items(1, 256)[0].prompt], params, use_tqdm=False)
    cpu_time = lambda: (lambda usage: usage.ru_utime + usage.ru_stime)(resource.getrusage(resource.RUSAGE_SELF))
    start, start_cpu = time.perf_counter(), cpu_time()
    outputs = llm.generate([item.prompt for item in items], params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, cpu_time() - start_cpu
    correct = sum(is_correct(item, out.text) for item, out in zip(items, outputs))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return dict(method=method, prompts=count, max_rss=max_rss, seconds=seconds, cpu_seconds=cpu_seconds,
                steps=sum(out.steps for out in outputs), correct=correct)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompt-length", type=int, default=8000)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one method, in this process
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_method(args.methods[0], args.num_prompts, args.prompt_length)))
        return
    rows = []
    for method in args.methods:
        command = [sys.executable, __file__, "--worker", "--methods", method, "--num-prompts", str(args.num_prompts),
                   "--prompt-length", str(args.prompt_length)]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
        if done.returncode != 0:  # e.g. killed for memory: a row that says so
            print(f"{method}: exit code {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
            rows.append(dict(method=method, prompts=args.num_prompts, failed=done.returncode))
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{method}: {rows[-1]}", file=sys.stderr, flush=True)
    dual = next((r["seconds"] for r in rows if r["method"] == "dual-cache" and "seconds" in r), None)
    print(f"\n{args.num_prompts} passkey prompts of {args.prompt_length} tokens in one LLM.generate call, embedded "
          f"model, CPU fp32, {os.cpu_count()} cores\n")
    print("| method | prompts | max RSS GB | s per prompt | vs dual-cache | CPU s per prompt | steps | accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['method']} | {r['prompts']} | failed (exit code {r['failed']}) | | | | | |")
            continue
        ratio = f"{r['seconds'] / dual:.2f}x" if dual else "-"
        print(f"| {r['method']} | {r['prompts']} | {r['max_rss'] / 1e9:.2f} | {r['seconds'] / r['prompts']:.1f} | "
              f"{ratio} | {r['cpu_seconds'] / r['prompts']:.1f} | {r['steps']} | {r['correct']}/{r['prompts']} |")


if __name__ == "__main__":
    main()
