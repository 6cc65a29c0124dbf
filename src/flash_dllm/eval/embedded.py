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
    texts: tuple[str, ...]      # each item's generated text
    verdicts: tuple[bool, ...]  # each item's answer is correct
    tokens: int                 # generated tokens (up to eos/eot) over all items
    steps: int                  # denoising steps (iterations) over all items
    nfe: int                    # forward passes over all items
    query_rows: int             # rows computed over all forward passes
    wall_s: float               # the wall time of generation

    @property
    def num_items(self) -> int:
        return len(self.verdicts)

    @property
    def num_correct(self) -> int:
        return sum(self.verdicts)

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_items

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.steps)


def run_task(llm, task: str, label: str, items: list[Item], params: SamplingParams) -> TaskResult:
    """Decode the items in one call; the caller warms the method up first."""
    if not items:
        raise ValueError(f"{task}: no items to run")
    start = time.perf_counter()
    outputs = llm.generate([item.prompt for item in items], params, use_tqdm=False)
    wall = time.perf_counter() - start
    return TaskResult(
        task=task, label=label, texts=tuple(out.text for out in outputs),
        verdicts=tuple(is_correct(item, out.text) for item, out in zip(items, outputs)),
        tokens=sum(len(out.token_ids) for out in outputs), steps=sum(out.steps for out in outputs),
        nfe=sum(out.nfe for out in outputs), query_rows=sum(out.query_rows for out in outputs), wall_s=wall)
