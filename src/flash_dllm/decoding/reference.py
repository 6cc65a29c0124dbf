"""LLaDA's reference sampler: per block, its share of the `steps` denoising steps (`steps / num_blocks` each
where max_tokens is a multiple of block_length; in general in proportion to the blocks' lengths, `block_steps`),
the linear schedule of tokens per step (the block's length spread evenly, the first length % steps steps get one
more), the top-k confidence (or, remasking="random", uniformly random) masked positions of the block; a full
forward every step, twice with classifier-free guidance (the unconditional copy has its prompt replaced by
masks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import ATTENTION_KINDS
from .base import Settings, StepPlan, check, knob
from .block import BlockMethod, block_sizes
from .sampling import REMASK_STREAM, counter_uniform
from .transfer import linear_schedule, transfer_top_k

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner
    from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class ReferenceSettings(Settings):
    steps: int | None = knob(None, "total denoising steps, at least one per block, shared by the blocks in "
                                   "proportion to their lengths (default: max_tokens, one token per step)")
    remasking: str = knob("low_confidence", "which masked positions a step unmasks",
                          choices=("low_confidence", "random"))
    cfg_scale: float = knob(0.0, "classifier-free guidance scale (0: none)")

    def __post_init__(self):
        super().__post_init__()
        check(self.cfg_scale >= 0, f"cfg_scale must be >= 0, got {self.cfg_scale}")


def block_steps(params: SamplingParams, block_index: torch.Tensor) -> torch.Tensor:
    """The denoising steps of each block [B] of block_index [B]: `steps` in proportion to the blocks' lengths,
    block b ending at step floor(steps * end_b / max_tokens) (end_b: its end offset in the generated region).
    With steps >= num_blocks every block gets at least one (a full block's share is >= 1 before rounding, and
    the last ends at `steps`, after the one before it); with max_tokens a multiple of block_length and steps a
    multiple of num_blocks, steps / num_blocks each (LLaDA's rule); with steps == max_tokens, each block its
    length (one token per step)."""
    steps = params.settings.steps or params.max_tokens
    end_step = lambda b: steps * (b * params.block_length).clamp(max=params.max_tokens) // params.max_tokens
    return end_step(block_index + 1) - end_step(block_index)


class Reference(BlockMethod):
    name = "reference"
    handles_logit_shift = True  # full forwards: the runner's full_logits applies the shift
    attention_patterns = ATTENTION_KINDS  # full forwards, under the model's pattern
    Settings = ReferenceSettings

    def validate(self, params: SamplingParams):
        steps = params.settings.steps
        if steps is not None:
            check(steps >= params.num_blocks,
                  f"steps ({steps}) must be at least the number of blocks "
                  f"({params.num_blocks} = max_tokens / block_length, rounded up)")

    def passes_per_step(self, batch: DecodeBatch) -> int:
        return 2 if batch.params.settings.cfg_scale > 0 else 1

    def block_logits(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor,
                     plan: StepPlan) -> torch.Tensor:
        tokens, attention_mask, positions = batch.tokens, batch.attention_mask, batch.positions
        guidance = batch.params.settings.cfg_scale
        if guidance > 0:  # the unconditional copy has its prompt replaced by masks
            is_prompt = attention_mask & (torch.arange(tokens.shape[1], device=tokens.device) < batch.gen_start)
            tokens = torch.cat([tokens, tokens.masked_fill(is_prompt, batch.mask_id)])
            attention_mask, positions, columns = (torch.cat([t, t]) for t in (attention_mask, positions, columns))
        logits = runner.full_logits(tokens, positions, attention_mask, columns)
        if guidance > 0:
            cond, uncond = logits.chunk(2)
            logits = uncond + (guidance + 1) * (cond - uncond)
        return logits

    def confidence(self, batch: DecodeBatch, offsets: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        if batch.params.settings.remasking == "random":
            return counter_uniform(batch.seed, batch.counters.steps, offsets, REMASK_STREAM)
        return confidence

    def unmask(self, batch: DecodeBatch, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        params, block = batch.params, batch.counters.block_index
        k = linear_schedule(block_sizes(params, block), block_steps(params, block), batch.counters.step_in_block)
        return transfer_top_k(confidence, masked, k)
