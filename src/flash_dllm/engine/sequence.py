"""One generation request and its host-side bookkeeping."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    # Device state while the sequence sits outside a batch (between admissions): its tokens without
    # padding [P + G] and its counters [block_index, step_in_block, steps, nfe].
    tokens: torch.Tensor | None = None
    counters: torch.Tensor | None = None
    position_state: dict[str, torch.Tensor] = field(default_factory=dict)  # method state per position [P + G]
    # Host copies of the block phase, refreshed at the engine's one sync per step.
    block_index: int = 0
    step_in_block: int = 0
    cache_base: int | None = None  # first row of the sequence's range in the KV cache
    query_rows: int = 0  # query rows computed for this sequence over all its forward passes
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    steps: int = 0
    nfe: int = 0
    start_time: float | None = None
    finish_time: float | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, output_ids: list[int], reason: str, steps: int, nfe: int):
        """reason: "stop" (an eos/eot was generated), "length" or "abort"."""
        self.output_ids, self.steps, self.nfe = output_ids, steps, nfe
        self.finish_reason = reason
        self.status = SequenceStatus.FINISHED
        self.tokens = self.counters = self.cache_base = None
        self.position_state = {}
        self.finish_time = time.perf_counter()
