"""Issue 40's probe: what a request waits for the first time its batch shape is seen, after the server's warm-up.

For each method and batch shape (requests x prompt length), the same `generate` is made twice in one process after
`engine/warmup.before_ready` and `stop_capturing` (what `serve` runs before it reports ready); the first call's
extra wall over its repeat is what a request waits for compiles and captures. Also reported: the compiles and
captures counted during the first calls (engine/counters.py). Random prompt ids on the model given (random
LLaDA-8B by default), greedy.

    python benchmarks/first_call_probe.py [--model random:llada-8b] [--max-tokens 32] [--lazy | --offline]

--lazy keeps capturing CUDA graphs after the warm-up (as before issue 40), for comparison. --offline runs no server
warm-up: `LLM.generate` as a script calls it (its own warm-up at each method's first use, in `warm_up_seconds`, and
CUDA graphs captured lazily), with one more shape per method, one request of 256 + 256 tokens (the steady speed
that the lazy captures buy).
"""
from __future__ import annotations

import argparse
import time

import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.engine.counters import ReadyMark
from flash_dllm.engine.warmup import before_ready
from flash_dllm.markdown import markdown_table

SHAPES = [(1, 256), (2, 256), (3, 300), (5, 700), (7, 1000), (16, 500)]
METHODS = ["dual-cache", "flash-cache", "flash-verify", "elastic"]
OFFLINE_STEADY = (1, 256, 256)  # requests, prompt, generated
ROUTED_PROMPT = 8192  # or the longest the model holds
ROUTED_MAX_TOKENS = (32, 96)  # a second generation length: a new shape for the routed passes


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llada-8b")
    parser.add_argument("--max-tokens", type=int, default=32)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lazy", action="store_true", help="capture CUDA graphs after the warm-up too")
    mode.add_argument("--offline", action="store_true", help="no server warm-up: LLM.generate's own")
    args = parser.parse_args()
    llm = LLM(args.model, device="cuda", dtype="bfloat16", max_batch_size=32)
    if not args.offline:
        start = time.perf_counter()
        before_ready(llm)
        if not args.lazy:
            llm.runner.graphs.stop_capturing()
        print(f"warm-up {time.perf_counter() - start:.1f} s", flush=True)
    generator = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size

    def prompts(batch: int, length: int) -> list[list[int]]:
        return torch.randint(1000, vocab - 1000, (batch, length), generator=generator).tolist()

    shapes = [(b, n, args.max_tokens) for b, n in SHAPES] + ([OFFLINE_STEADY] if args.offline else [])
    cases = [(method, None, f"{b}x{n}" + (f", {t} tokens" if t != args.max_tokens else ""), prompts(b, n), t)
             for method in METHODS for b, n, t in shapes]
    routed_length = min(ROUTED_PROMPT, llm.config.max_position - max(ROUTED_MAX_TOKENS))  # random LLaDA-8B: 4096
    routed_prompt = prompts(1, routed_length)
    cases += [("flash-cache", "chunk", f"1x{routed_length}, {t} tokens", routed_prompt, t) for t in ROUTED_MAX_TOKENS]
    rows = []
    for method, routing, shape, batch, max_tokens in cases:
        params = SamplingParams(method=method, max_tokens=max_tokens, block_length=32, kv_routing=routing)
        mark = ReadyMark()
        mark.mark()
        warmed = sum(llm.warm_up_seconds.values())
        first = timed_generate(llm, batch, params)
        after = mark.after()
        warm_up = sum(llm.warm_up_seconds.values()) - warmed  # the offline warm-up of a method's first call
        repeat = timed_generate(llm, batch, params)
        rows.append((method + (f" ({routing})" if routing else ""), shape, f"{warm_up:.2f}", f"{first - warm_up:.2f}",
                     f"{repeat:.2f}", f"{first - warm_up - repeat:+.2f}",
                     f"{after['compiles'].count} ({after['compiles'].seconds:.2f} s)",
                     f"{after['captures'].count} ({after['captures'].seconds:.2f} s)"))
        print(" | ".join(map(str, rows[-1])), flush=True)
    print(markdown_table(("method", "shape", "warm-up s", "first s", "repeat s", "extra s", "compiles", "captures"),
                         rows))


if __name__ == "__main__":
    main()
