"""Accuracy and speed of a decoding method on the embedded task suite."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..sampling_params import SamplingParams
from ..tasks import Item, extract_answer, is_correct


@dataclass(frozen=True)
class TaskResult:
    task: str
    label: str
    answers: tuple[str | None, ...]  # each item's value after its last ####, None where there is none
    verdicts: tuple[bool, ...]       # each item's answer is correct
    nfe: float              # forward passes per item
    tokens_per_step: float  # generated tokens (up to eos/eot) per denoising step (iteration)
    query_rows_per_step: float
    tokens_per_s: float     # generated tokens over the wall time of generation

    @property
    def num_items(self) -> int:
        return len(self.verdicts)

    @property
    def num_correct(self) -> int:
        return sum(self.verdicts)

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_items


def run_task(llm, task: str, label: str, items: list[Item], params: SamplingParams) -> TaskResult:
    """Decode the items in one call; the caller warms the method up first."""
    if not items:
        raise ValueError(f"{task}: no items to run")
    start = time.perf_counter()
    outputs = llm.generate([item.prompt for item in items], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(out.token_ids) for out in outputs)
    steps = max(1, sum(out.steps for out in outputs))
    return TaskResult(
        task=task, label=label, answers=tuple(extract_answer(out.text) for out in outputs),
        verdicts=tuple(is_correct(item, out.text) for item, out in zip(items, outputs)),
        nfe=sum(out.nfe for out in outputs) / len(outputs),
        tokens_per_step=tokens / steps,
        query_rows_per_step=sum(out.query_rows for out in outputs) / steps,
        tokens_per_s=tokens / wall,
    )
