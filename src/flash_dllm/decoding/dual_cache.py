"""Fast-dLLM's dual cache, with the parallel rule: a full forward at each block start (and every
`refresh_interval` steps of a block) rewrites every position's K/V; the other steps recompute the block
alone and read the rest of the sequence, before and after it, from the cache."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .prefix_cache import PrefixCache

if TYPE_CHECKING:
    from ..batch import RowState
    from ..sampling_params import SamplingParams


class DualCache(PrefixCache):
    name = "dual-cache"

    def reused_rows(self, row: RowState, block_start: int, block_length: int) -> int:
        return min(block_length, row.length - block_start)  # the last block may be shorter

    def steady_pass(self, params: SamplingParams, logit_shift: int) -> tuple[int, bool]:
        return params.block_length + logit_shift, False  # the block, after the columns of its first logits
