"""Fast-dLLM's prefix cache, with the parallel rule: a full forward at each block start (and every
`refresh_interval` steps of a block) rewrites every position's K/V; the other steps recompute the block and
everything after it, and read the prefix from the cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cache.attention_metadata import device_tensor
from .base import check, knob
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
    handles_logit_shift = False  # a block's first column needs the cached column before it (issue 14)
    Settings = PrefixCacheSettings
    uses_cache = True
    demo_variants = None

    def reused_range(self, row: RowState, block_start: int, block_length: int) -> tuple[int, int]:
        """First position and number of query rows of a step that reuses the cache."""
        return block_start, row.length - block_start

    def query_ranges(self, batch: DecodeBatch) -> tuple[list[int], list[int]]:
        """Per row: first query position and number of query rows (a refresh step: all of them)."""
        params = batch.params
        interval = params.settings.refresh_interval
        ranges = []
        for row in batch.rows:
            block_start = row.prompt_length + row.block_index * params.block_length
            if row.step_in_block == 0 or (interval is not None and row.step_in_block % interval == 0):
                ranges.append((0, row.length))
            else:
                ranges.append(self.reused_range(row, block_start, params.block_length))
        starts, counts = zip(*ranges)
        return list(starts), list(counts)

    def block_logits(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor) -> torch.Tensor:
        starts, counts = self.query_ranges(batch)
        batch.count_query_rows(counts)
        first = batch.tokens.shape[1] - batch.lengths + device_tensor(starts, batch.tokens.device)
        query_columns = first[:, None] + torch.arange(max(counts), device=first.device)
        p = runner.prepare(batch, counts, query_columns)
        return runner.logits(runner.run(p), p.flat_of_column, columns)
