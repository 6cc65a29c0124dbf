"""The iteration of the methods that decode block by block: logits for each row's current block, candidate
tokens and confidences, the method's unmasking rule, then the block phase advances. Rows advance together
in tensor ops; the only host inputs are the step's plan, made from the per-row block phase read at the
engine's one sync per step."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import DecodingMethod, StepPlan
from .sampling import sample_tokens

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner
    from ..sampling_params import SamplingParams


def block_columns(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's current block: offsets within the generated region and columns within the row, [B, n] with
    n = min(block_length, max_tokens). Where max_tokens is not a multiple of block_length the last block is
    shorter: its n columns then end at the canvas end, the first ones the previous block's (all decoded, so no
    rule unmasks them and they keep their tokens), which keeps every column in range and distinct (a scatter
    over them has no duplicates)."""
    params = batch.params
    n = min(params.block_length, params.max_tokens)
    start = (batch.counters.block_index * params.block_length).clamp(max=params.max_tokens - n)
    offsets = start[:, None] + torch.arange(n, device=batch.tokens.device)
    return offsets, batch.gen_start + offsets


def block_sizes(params: SamplingParams, block_index: torch.Tensor) -> torch.Tensor:
    """The length of each block [B] of block_index [B]: block_length, but the last holds what is left of
    max_tokens."""
    return (params.max_tokens - block_index * params.block_length).clamp(max=params.block_length)


class BlockMethod(DecodingMethod):
    """Subclasses give the block's logits (`block_logits`) and the rule (`unmask`), or a whole `transfer`, and
    the shape of the passes (`plan`: by default one full forward)."""

    def plan(self, runner: ModelRunner, batch: DecodeBatch) -> StepPlan:
        counts = tuple(row.length * self.passes_per_step(batch) for row in batch.rows)
        batch.count_query_rows(counts)
        return StepPlan(counts)

    def block_logits(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor,
                     plan: StepPlan) -> torch.Tensor:
        """Logits [B, n, V] of the block columns [B, n] (fp32 from full passes, the model's dtype from cached ones)."""
        raise NotImplementedError

    def unmask(self, batch: DecodeBatch, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """Which masked positions [B, n] to unmask, from confidence [B, n] (-inf where not masked)."""
        raise NotImplementedError

    def confidence(self, batch: DecodeBatch, offsets: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """The score the rule ranks positions by: the candidates' probability, unless the method says otherwise."""
        return confidence

    def passes_per_step(self, batch: DecodeBatch) -> int:
        return 1

    def transfer(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor, offsets: torch.Tensor,
                 plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate tokens [B, n] for the block and which positions to unmask [B, n]."""
        logits = self.block_logits(runner, batch, columns, plan)
        masked = batch.tokens.gather(1, columns) == batch.mask_id
        candidates, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.counters.steps, offsets,
                                               sample=batch.is_sampling, mask_id=batch.mask_id, kernels=runner.kernels)
        confidence = self.confidence(batch, offsets, confidence).masked_fill(~masked, float("-inf"))
        return candidates, self.unmask(batch, confidence, masked)

    def note_transfer(self, batch: DecodeBatch, columns: torch.Tensor, transfer: torch.Tensor):
        """Per-position bookkeeping of what this step decoded (before the tokens change)."""

    def run(self, runner: ModelRunner, batch: DecodeBatch, plan: StepPlan):
        offsets, columns = block_columns(batch)
        candidates, transfer = self.transfer(runner, batch, columns, offsets, plan)
        self.note_transfer(batch, columns, transfer)
        block = torch.where(transfer, candidates, batch.tokens.gather(1, columns))
        batch.tokens.scatter_(1, columns, block)
        counters = batch.counters
        counters.nfe += self.passes_per_step(batch)
        counters.steps += 1
        block_done = ~(block == batch.mask_id).any(dim=1)
        counters.block_index += block_done.long()
        counters.step_in_block.copy_(torch.where(block_done, 0, counters.step_in_block + 1))
