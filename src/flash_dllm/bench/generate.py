"""`flash-dllm bench generate`: decoding end to end through `LLM.generate`, per method and batch size.

One timed call per (method, batch) after an untimed warm-up call on the same prompts with fewer tokens (it
allocates the KV cache and compiles the kernels). The prompts are random token ids of one length (`random`:
random weights decode one token per step from them), or the embedded tasks' held-out word problems and programs
as chat (`tasks`: a trained model answers them, where it would stop at once on random ids and leave no tokens to
count). The timed call captures
the CUDA graphs that the warm-up could not, as a server does for a new batch: the whole-step graphs (keyed by
the batch) and Elastic-Cache's (keyed by the sequence's width too), each at its second sighting (Elastic-Cache's
refresh at its fourth). Reported: wall time over engine iterations (admission, the first full pass, scheduling
and the host reads included, unlike `bench step`), tokens/s as the project defines it (tokens up to the first
eos/eot over the call's wall time), NFE per request and tokens per step.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..decoding.registry import method_of
from ..markdown import markdown_table
from ..llm import Messages
from ..sampling_params import SamplingParams
from .step import with_tensor_parallel


@dataclass(frozen=True)
class GenerateResult:
    method: str
    batch: int
    block: int | None  # None: the method has no blocks
    wall_s: float
    iterations: int    # engine iterations: the most steps of any request (they run together)
    tokens: int        # generated, up to and excluding each request's first eos/eot
    steps: int         # summed over requests
    nfe: int           # summed over requests
    tp_size: int = 1   # tensor-parallel ranks
    collective_s: float = 0.0  # the driver's wall time in the tensor-parallel collectives

    @property
    def collective_ms(self) -> float:  # per iteration
        return self.collective_s * 1e3 / self.iterations

    @property
    def ms_per_iter(self) -> float:
        return self.wall_s * 1e3 / self.iterations

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def random_prompts(llm, batch: int, length: int, seed: int) -> list[list[int]]:
    """Token ids drawn uniformly from the vocabulary, without the mask and stop tokens."""
    generator = torch.Generator().manual_seed(seed)
    special = {llm.special.mask_id, *llm.special.stop_ids}
    filler = min(set(range(len(special) + 1)) - special)
    ids = torch.randint(0, llm.config.vocab_size, (batch, length), generator=generator)
    return ids.masked_fill(torch.isin(ids, torch.tensor(sorted(special))), filler).tolist()


def task_prompts(batch: int) -> list[Messages]:
    """The embedded tasks' first held-out arith and trace items, alternating, as one-turn chats."""
    from ..tasks import load_test_set

    arith, trace = load_test_set("arith"), load_test_set("trace")
    items = [item for pair in zip(arith, trace) for item in pair]
    return [[{"role": "user", "content": items[i % len(items)].prompt}] for i in range(batch)]


def bench_generate(llm, params: SamplingParams, batch: int, prompt_length: int | None,
                   seed: int = 0) -> GenerateResult:
    """prompt_length: random prompts of that many tokens; None: the task prompts (the model needs a tokenizer)."""
    if batch > llm.engine.scheduler.max_batch_size:
        raise ValueError(f"batch {batch} is larger than the LLM's max_batch_size "
                         f"({llm.engine.scheduler.max_batch_size}): its requests would not run together")
    method = method_of(params.method, llm.config.attention.kind)
    warm_tokens = min(params.max_tokens, 2 * params.block_length if method.uses_blocks else 32)
    prompts = task_prompts(batch) if prompt_length is None else random_prompts(llm, batch, prompt_length, seed)
    llm.generate(prompts, dataclasses.replace(params, max_tokens=warm_tokens), use_tqdm=False)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    timer = llm.tp.timer
    timer.reset(enabled=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - start
    collective_s = timer.seconds()
    timer.reset(enabled=False)
    failed = [out.error for out in outputs if out.error is not None]
    if failed:
        raise RuntimeError(f"bench generate: {params.method} batch {batch}: {failed[0]}")
    return GenerateResult(params.method, batch, params.block_length if method.uses_blocks else None, wall,
                          max(out.steps for out in outputs), sum(len(out.token_ids) for out in outputs),
                          sum(out.steps for out in outputs), sum(out.nfe for out in outputs), llm.tp.size, collective_s)


def format_table(results: list[GenerateResult]) -> str:
    header = ("method", "batch", "block", "wall s", "iterations", "ms/iter", "tokens", "tok/s", "NFE/request",
              "tokens/step")
    rows = [(r.method, r.batch, "-" if r.block is None else r.block, f"{r.wall_s:.2f}", r.iterations,
             f"{r.ms_per_iter:.2f}", r.tokens, f"{r.tokens_per_s:.1f}", f"{r.nfe / r.batch:.1f}",
             f"{r.tokens / max(r.steps, 1):.2f}") for r in results]
    return markdown_table(*with_tensor_parallel(header, rows, results, "ms/iter"))
