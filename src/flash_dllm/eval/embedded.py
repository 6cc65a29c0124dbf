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
    tokens_per_step: float  # generated tokens (up to eos/eot) per denoising step (iteration)
    query_rows_per_step: float
    tokens_per_s: float     # generated tokens over the wall time of generation


def run_task(llm, task: str, label: str, items: list[Item], params: SamplingParams) -> TaskResult:
    """Decode the items in one call; the caller warms the method up first."""
    start = time.perf_counter()
    outputs = llm.generate([item.prompt for item in items], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(out.token_ids) for out in outputs)
    steps = max(1, sum(out.steps for out in outputs))
    return TaskResult(
        task=task, label=label, num_items=len(items),
        accuracy=sum(is_correct(item, out.text or "") for item, out in zip(items, outputs)) / len(items),
        nfe=sum(out.nfe for out in outputs) / len(outputs),
        tokens_per_step=tokens / steps,
        query_rows_per_step=sum(out.query_rows for out in outputs) / steps,
        tokens_per_s=tokens / wall,
    )
