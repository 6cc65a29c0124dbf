"""The embedded tasks in the batch-invariant mode at batch sizes 1, 8 and 32: accuracy and whether every output is
the same token for token (the embedded default model, bf16, on the CPU unless --device says otherwise, the first
N items of each task).

    PYTHONPATH=src python benchmarks/batch_invariance_tasks.py [--items 100] [--methods flash-cache ...]
"""
import argparse

from flash_dllm import LLM, SamplingParams
from flash_dllm.markdown import markdown_table
from flash_dllm.tasks import is_correct, load_test_set

TASKS = ("arith", "trace", "passkey")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=["parallel", "dual-cache", "flash-cache", "flash-verify"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    llms = {size: LLM(device=args.device, dtype=args.dtype, max_batch_size=size, batch_invariant=True)
            for size in (1, 8, 32)}
    rows = []
    for method in args.methods:
        params = SamplingParams(method=method, max_tokens=128, block_length=32)
        for task in TASKS:
            items = [item for item in load_test_set(task) if task != "passkey" or item.length == 256][:args.items]
            outputs = {size: llm.generate([item.prompt for item in items], params, use_tqdm=False)
                       for size, llm in llms.items()}
            accuracy = {size: sum(is_correct(item, out.text or "") for item, out in zip(items, outs)) / len(items)
                        for size, outs in outputs.items()}
            same = sum(outputs[1][i].token_ids == outputs[8][i].token_ids == outputs[32][i].token_ids
                       for i in range(len(items)))
            rows.append((method, task, len(items), *(f"{accuracy[s]:.2f}" for s in (1, 8, 32)), f"{same}/{len(items)}"))
            print(" | ".join(map(str, rows[-1])), flush=True)
    print(markdown_table(("method", "task", "items", "accuracy b1", "accuracy b8", "accuracy b32",
                          "identical at 1, 8, 32"), rows))


if __name__ == "__main__":
    main()
