"""Issue 38's accuracy gates, in one process: FP8 against the model's dtype.

logits   random LLaDA-8B and Dream-7B weights (bf16, the same draw quantised), or the trained embedded model
         (`--presets embedded`): the full forward's logits of random prompts, per-row cosine (median, 1st percentile, min) and relative error, and how often the argmax agrees;
tasks    the embedded model on its tasks (arith, trace, passkey, multikey), every cached method: accuracy with FP8
         weights, FP8 KV and both, beside the unquantised model's (bf16 on the GPU, fp32 on the CPU), with 95% Wilson
         intervals.

    PYTHONPATH=src python benchmarks/fp8_accuracy.py logits --presets llada-8b dream-7b embedded
    PYTHONPATH=src python benchmarks/fp8_accuracy.py tasks --items 200
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import torch
import torch.nn.functional as F

from flash_dllm import LLM, SamplingParams
from flash_dllm.cli import demo_variants
from flash_dllm.eval.embedded import run_task
from flash_dllm.markdown import markdown_table
from flash_dllm.llm import default_model_path
from flash_dllm.models import load_model, random_model
from flash_dllm.tasks import RETRIEVAL_TASKS, answer_length, load_test_set

EMBEDDED = "embedded"  # the trained embedded model, where the random presets' depth amplifies every rounding
OPTIONS = {"unquantised": {}, "fp8 weights": dict(quantization="fp8"), "fp8 KV": dict(kv_cache_dtype="fp8"),
           "both": dict(quantization="fp8", kv_cache_dtype="fp8")}


@torch.inference_mode()
def logits_rows(presets: list[str], batch: int, length: int, device: str) -> list[tuple]:
    """Per preset and depth (the first layer alone, then every layer): fp8 against bf16, beside bf16 against fp32
    (how far the model's depth carries bf16's own rounding: random weights amplify a perturbation layer by layer)."""
    rows = []
    for preset in presets:
        logits = {}
        for name, quantization in (("fp32", None), ("bf16", None), ("fp8 weights", "fp8")):
            # fp32: the bf16 draw cast up (CUDA's normal_ draws other values into an fp32 tensor of some shapes)
            model = (load_model(default_model_path(), device, torch.bfloat16, quantization) if preset == EMBEDDED
                     else random_model(preset, device, torch.bfloat16, seed=0, quantization=quantization))
            if name == "fp32":
                model = model.float()
            ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
            layers = model.layers
            for depth in (1, len(layers)):
                model.layers = layers[:depth]
                logits[name, depth] = model(ids.to(device)).float().flatten(0, 1)
            del model, layers
            gc.collect()
            torch.cuda.empty_cache()
        for depth in sorted({d for _, d in logits}):
            for name, base in (("bf16", "fp32"), ("fp8 weights", "bf16")):
                got, ref = logits[name, depth], logits[base, depth]
                cosine = F.cosine_similarity(got.double(), ref.double(), dim=-1)
                rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
                agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
                rows.append((preset, depth, f"{name} vs {base}", f"{cosine.median():.5f}", f"{cosine.quantile(0.01):.5f}",
                             f"{cosine.min():.5f}", f"{rel.median():.4f}", f"{rel.max():.4f}", f"{100 * agree:.1f}"))
                print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    return rows


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = correct / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def task_rows(methods: list[str], tasks: list[str], items: int, device: str, options: list[str]) -> list[tuple]:
    test_sets = {}
    for task in tasks:
        test_set = load_test_set(task)
        if task in RETRIEVAL_TASKS:  # the shortest prompts, as `demo`
            shortest = min(item.length for item in test_set)
            test_set = [item for item in test_set if item.length == shortest]
        test_sets[task] = test_set[:items]
    variants, rows, accuracy = demo_variants(), [], {}
    for option in options:
        llm = LLM(device=device, **OPTIONS[option])
        for method in methods:
            for task, test_set in test_sets.items():
                params = SamplingParams(max_tokens=answer_length(task), **variants[method])
                llm.generate(test_set[0].prompt, params)  # compiles and captures out of the way
                r = run_task(llm, task, method, test_set, params)
                accuracy[option, method, task] = r.accuracy
                low, high = wilson(r.num_correct, r.num_items)
                delta = 100 * (r.accuracy - accuracy.get(("unquantised", method, task), r.accuracy))
                rows.append((option, method, task, f"{r.num_correct}/{r.num_items}", f"{100 * r.accuracy:.1f}",
                             f"[{100 * low:.1f}, {100 * high:.1f}]", f"{delta:+.1f}", f"{r.tokens_per_step:.2f}"))
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        del llm
        gc.collect()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gate", choices=["logits", "tasks"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--presets", nargs="+", default=["llada-8b", "dream-7b", EMBEDDED])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--methods", nargs="+", default=["dual-cache", "flash-cache", "flash-verify", "elastic"])
    parser.add_argument("--tasks", nargs="+", default=["arith", "trace", "passkey", "multikey"])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS))
    args = parser.parse_args()
    start = time.perf_counter()
    if args.gate == "logits":
        print(markdown_table(("model", "layers", "option", "cosine median", "cosine p1", "cosine min",
                              "rel err median", "rel err max", "argmax agrees %"),
                             logits_rows(args.presets, args.batch, args.length, args.device)))
    else:
        print(markdown_table(("option", "method", "task", "correct", "accuracy %", "95% interval", "vs unquantised",
                              "tokens/step"), task_rows(args.methods, args.tasks, args.items, args.device,
                                                                args.options)))
    print(f"# {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
