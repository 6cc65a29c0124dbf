"""Fast-dLLM's prefix cache, with the parallel rule: a full forward at each block start (and every
`refresh_interval` steps of a block) rewrites every position's K/V; the other steps recompute the block and
everything after it, and read the prefix from the cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import StepPlan, check, knob
from .parallel import Parallel, ParallelSettings

if TYPE_CHECKING:
    from ..batch import DecodeBatch, RowState
    from ..engine.model_runner import ModelRunner


@dataclass(frozen=True)
class PrefixCacheSettings(ParallelSettings):
    refresh_interval: int | None = knob(None, "also recompute everything every N steps of a block "
                                              "(1: no reuse, the tokens of parallel)", symbol="k")

    def __post_init__(self):
        super().__post_init__()
        if self.refresh_interval is not None:
            check(self.refresh_interval > 0, f"refresh_interval must be positive, got {self.refresh_interval}")


class PrefixCache(Parallel):
    name = "prefix-cache"
    # A step that reuses the cache also recomputes the logit_shift columns before the block (their hidden states
    # give the block's first logits) without writing their K/V: the cache stays as the unshifted method leaves it.
    handles_logit_shift = True
    Settings = PrefixCacheSettings
    uses_cache = True
    attention_patterns = ("bidirectional",)  # its cached passes read each request's whole range
    demo_variants = None

    replayable = True

    def reused_rows(self, row: RowState, block_start: int, block_length: int) -> int:
        """Query rows of a step that reuses the cache: from the block start to the end."""
        return row.length - block_start

    def plan(self, runner: ModelRunner, batch: DecodeBatch) -> StepPlan:
        """Per row: a refresh (every position) or a reuse of the cache, and its query rows. A reuse step also
        recomputes the logit_shift columns before the block (the columns whose hidden states give a shifted
        architecture's logits of the block), whose K/V it reads from the cache and does not write.
        plan.extra: the rows that refresh."""
        params, shift = batch.params, runner.logit_shift
        interval = params.settings.refresh_interval
        counts, refresh = [], []
        for row in batch.rows:
            block_start = row.prompt_length + row.block_index * params.block_length
            refresh.append(row.step_in_block == 0 or (interval is not None and row.step_in_block % interval == 0))
            reused = self.reused_rows(row, block_start, params.block_length) + shift
            counts.append(row.length if refresh[-1] else reused)
        batch.count_query_rows(counts)
        return StepPlan(tuple(counts), tuple(refresh))

    def block_logits(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor,
                     plan: StepPlan) -> torch.Tensor:
        shift, width, refresh = runner.logit_shift, batch.tokens.shape[1], plan.extra
        reused_start = batch.gen_start + batch.counters.block_index * batch.params.block_length - shift
        first = torch.where(runner.constant(list(refresh)).bool(), width - batch.lengths, reused_start)
        query_columns = first[:, None] + torch.arange(max(plan.counts), device=first.device)
        p = runner.prepare(batch, list(plan.counts), query_columns, kept=[0 if r else shift for r in refresh])
        return runner.logits(runner.run(p), p.flat_of_column, columns)
