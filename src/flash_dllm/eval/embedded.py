"""Accuracy and speed of a decoding method on the embedded task suite."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..sampling_params import SamplingParams
from ..tasks import Item, is_correct


@dataclass(frozen=True)
class TaskResult:
    task: str
    label: str
    num_items: int
    accuracy: float
    nfe: float              # forward passes per item
    tokens_per_step: float  # generated tokens (up to eos/eot) per denoising step
    tokens_per_s: float     # generated tokens over the wall time of generation, after a warm-up
    query_rows_per_step: float


def run_task(llm, task: str, label: str, items: list[Item], params: SamplingParams) -> TaskResult:
    prompts = [item.prompt for item in items]
    llm.generate(prompts[:1], params)  # warm-up: first-call allocations and kernel selection
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(out.token_ids) for out in outputs)
    return TaskResult(
        task=task, label=label, num_items=len(items),
        accuracy=sum(is_correct(item, out.text) for item, out in zip(items, outputs)) / len(items),
        nfe=sum(out.nfe for out in outputs) / len(outputs),
        tokens_per_step=tokens / max(1, sum(out.steps for out in outputs)),
        tokens_per_s=tokens / wall,
        query_rows_per_step=sum(out.query_rows for out in outputs) / max(1, sum(out.steps for out in outputs)),
    )
