"""One generation request and its host-side bookkeeping."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..batch import RowState
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
    tail: int = 0  # positions after the generation that its method decodes and drops (DecodingMethod.tail_tokens)
    status: SequenceStatus = SequenceStatus.WAITING
    cache_base: int | None = None  # first row of the sequence's range in the KV cache, once admitted
    row: RowState | None = None    # its decoding state while running (in the batch, or between batches)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    steps: int = 0
    nfe: int = 0
    query_rows: int = 0  # query rows computed for this sequence over all its forward passes
    final_length: int = 0  # generated tokens known to be final: all decoded, up to the first mask or eos/eot
    prompt_kv_read: float | None = None  # with kv_routing, the fraction of the prompt's KV read (at finish)
    start_time: float | None = None
    finish_time: float | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens + self.tail

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, output_ids: list[int], reason: str, steps: int, nfe: int, prompt_kv_read: float | None = None):
        """reason: "stop" (an eos/eot was generated), "length" or "abort". prompt_kv_read: with routed prompt
        keys, the fraction of the prompt's KV that the passes read."""
        self.output_ids, self.steps, self.nfe, self.prompt_kv_read = output_ids, steps, nfe, prompt_kv_read
        self.finish_reason = reason
        self.status = SequenceStatus.FINISHED
        if self.row is not None:
            self.query_rows = self.row.query_rows
        self.row = self.cache_base = None
        self.finish_time = time.perf_counter()
