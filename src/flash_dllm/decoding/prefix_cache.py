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
    # A step that reuses the cache also recomputes the logit_shift columns before the block (their hidden states
    # give the block's first logits) without writing their K/V: the cache stays as the unshifted method leaves it.
    handles_logit_shift = True
    Settings = PrefixCacheSettings
    uses_cache = True
    demo_variants = None

    def reused_range(self, row: RowState, block_start: int, block_length: int) -> tuple[int, int]:
        """First position and number of query rows of a step that reuses the cache."""
        return block_start, row.length - block_start

    def query_ranges(self, batch: DecodeBatch, shift: int = 0) -> tuple[list[int], list[int], list[int]]:
        """Per row: first query position, number of query rows (a refresh step: all of them) and how many of
        the first rows only give hidden states (`shift` before a reused range: the columns whose hidden states
        give a shifted architecture's logits of the block; they are read from the cache, not written)."""
        params = batch.params
        interval = params.settings.refresh_interval
        ranges = []
        for row in batch.rows:
            block_start = row.prompt_length + row.block_index * params.block_length
            if row.step_in_block == 0 or (interval is not None and row.step_in_block % interval == 0):
                ranges.append((0, row.length, 0))
            else:
                start, count = self.reused_range(row, block_start, params.block_length)
                ranges.append((start - shift, count + shift, shift))
        starts, counts, kept = zip(*ranges)
        return list(starts), list(counts), list(kept)

    def block_logits(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor) -> torch.Tensor:
        starts, counts, kept = self.query_ranges(batch, runner.logit_shift)
        batch.count_query_rows(counts)
        first = batch.tokens.shape[1] - batch.lengths + device_tensor(starts, batch.tokens.device)
        query_columns = first[:, None] + torch.arange(max(counts), device=first.device)
        p = runner.prepare(batch, counts, query_columns, kept=kept)
        return runner.logits(runner.run(p), p.flat_of_column, columns)
