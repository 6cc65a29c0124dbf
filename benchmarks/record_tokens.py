"""Record the token ids every decoding method generates on held-out items of the embedded tasks, or compare
them with an earlier recording: the check that a refactor changed no behaviour.

    python benchmarks/record_tokens.py --out tokens.json                     # record
    python benchmarks/record_tokens.py --out after.json --compare before.json   # record and compare

fp32 on the CPU (or --device), the embedded default model, the first N items of each task's test set (passkey:
its 256-token items, the length `demo` uses), one `generate` call per method and task (batch 32).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from flash_dllm import LLM, SamplingParams
from flash_dllm.tasks import load_test_set

# Each method with the settings `flash-dllm demo` uses, written as SamplingParams keywords.
TASKS = ("arith", "trace", "passkey")
VARIANTS = {
    "reference": dict(method="reference"),
    "parallel": dict(method="parallel", threshold=0.9),
    "parallel-factor": dict(method="parallel", factor=1.0),
    "prefix-cache": dict(method="prefix-cache", threshold=0.9),
    "dual-cache": dict(method="dual-cache", threshold=0.9),
    "flash-cache": dict(method="flash-cache", threshold=0.9),
    "flash-verify": dict(method="flash-verify", threshold=0.9),
    "elastic": dict(method="elastic", threshold=0.9),
    "lossless": dict(method="lossless"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="an earlier recording: exit 1 if any token id differs")
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    llm = LLM(device=args.device, dtype="float32")
    items = {task: [item for item in load_test_set(task) if task != "passkey" or item.length == 256]
             for task in args.tasks}
    recorded = {}
    for label in args.variants:
        params = SamplingParams(max_tokens=args.max_tokens, block_length=32, **VARIANTS[label])
        for task, test_set in items.items():
            start = time.perf_counter()
            outputs = llm.generate([item.prompt for item in test_set[:args.items]], params)
            recorded[f"{label}/{task}"] = [out.token_ids for out in outputs]
            print(f"{label}/{task}: {len(outputs)} items, {time.perf_counter() - start:.1f} s", file=sys.stderr,
                  flush=True)
            with open(args.out, "w") as f:  # after every run, so that an interrupted recording keeps its part
                json.dump(recorded, f)
    if args.compare is None:
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    differing = 0
    for key, outputs in recorded.items():
        if key not in before:
            print(f"{key}: not in {args.compare}")
            continue
        same = sum(a == b for a, b in zip(outputs, before[key]))
        differing += len(outputs) - same
        print(f"{key}: {same}/{len(outputs)} identical")
    print(f"{'identical' if differing == 0 else f'{differing} outputs differ'} over {len(recorded)} runs")
    return int(differing > 0)


if __name__ == "__main__":
    sys.exit(main())
