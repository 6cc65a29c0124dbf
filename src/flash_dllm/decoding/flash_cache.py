"""Flash-Cache: selective cache update, with the parallel rule.

After a full first pass, a step recomputes a fixed-size set of query positions per sequence,
Q = min(beta_m + beta_t, L): the window of the beta_m (`mask_window`) leftmost masked positions, then
beta_t (`tracking_budget`) decoded positions in this order: those decoded in the previous step, then by
the softmax attention mass the masked queries gave them in the previous step (over layers and heads). When
fewer than beta_m masks remain, or fewer than beta_t positions are decoded, the spare rows go to the
remaining candidates (decoded positions, or the nearest masks beyond the window), so the query count stays
fixed. Every other position is read from the KV cache.

A request whose prompt KV is routed (`kv_routing`, with a budget under 1) tracks its generated part only
(Q = min(beta_m + beta_t, generated length)): its prompt's KV stays as the first pass wrote it, as in the dual
cache, so that its steps read the prompt routed (a step with prompt rows reads every prompt key for them).

On an architecture with shifted logits (Dream: column j's logits from the hidden state of column j - 1) the
window's logit sources rank above the window itself: a decoded source takes a tracking row, and where the
budget is short the last mask of a run of the window is read from the cache (its logits still come fresh from
its left neighbour). The tracked attention is the sources' (the queries that predict the masks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import StepPlan, check, knob
from .parallel import Parallel, ParallelSettings, ThresholdSettings

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner
    from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class SelectiveSettings(ThresholdSettings):
    """The query budget of Flash-Cache's steps (and Flash-Verify's draft passes)."""
    tracking_budget: int = knob(80, "decoded positions recomputed per step", symbol="beta_t")
    mask_window: int = knob(64, "masked positions recomputed per step (at least a block)", symbol="beta_m")

    def __post_init__(self):
        super().__post_init__()
        check(self.tracking_budget >= 0, f"tracking_budget must be >= 0, got {self.tracking_budget}")


@dataclass(frozen=True)
class FlashCacheSettings(SelectiveSettings, ParallelSettings):
    pass


@dataclass
class FlashCacheState:
    key_mass: torch.Tensor    # fp32: the attention mass the masked queries gave the position last step
    decoded_at: torch.Tensor  # long: the step that decoded the position; -1 for the prompt and for masks


def query_priority(batch: DecodeBatch, logit_sources=None,
                   frozen_prompt: torch.Tensor | None = None) -> torch.Tensor:
    """[B, W] score whose top-Q columns per row are the step's queries (-inf: never a query). logit_sources:
    the runner's map from columns to the columns that give their logits, for a shifted architecture.
    frozen_prompt [B, W] bool (DecodeBatch.frozen_prompt): columns that come last (routed prompts: never
    tracked)."""
    tokens, real, state = batch.tokens, batch.attention_mask, batch.state
    width = tokens.shape[1]
    columns = torch.arange(width, device=tokens.device)
    masked = (tokens == batch.mask_id) & (columns >= batch.gen_start)
    window = masked & (masked.cumsum(dim=1) <= batch.params.settings.mask_window)
    decoded = real & ~masked
    newly = decoded & (state.decoded_at == (batch.counters.steps - 1)[:, None])
    relative_mass = state.key_mass / (state.key_mass.amax(dim=1, keepdim=True) + 1e-30)  # in [0, 1]
    priority = torch.where(masked, 1.0 - columns / width, 2.0 + relative_mass)          # decoded above far masks
    if frozen_prompt is not None:  # a frozen prompt last (its positions are never decoded in a step)
        priority = priority.masked_fill(frozen_prompt, -1.0)
    priority = torch.where(newly, 3.5, priority)
    priority = torch.where(window, 5.0, priority)
    if logit_sources is not None:
        priority = torch.where(logit_sources(window), 6.0, priority)
    return priority.masked_fill(~real, float("-inf"))


class FlashCache(Parallel):
    name = "flash-cache"
    handles_logit_shift = True  # the window's logit sources rank first among its queries
    Settings = FlashCacheSettings
    uses_cache = True
    attention_patterns = ("bidirectional",)  # its cached passes read each request's whole range
    published_block_length = 16
    demo_variants = None
    replayable = True

    def check_model(self, config, params: SamplingParams):
        """Its rule picks from the whole block, whose masks the window must cover (on a block-causal model,
        `flash-cache` is decoding/block_diffusion.py's, whose window may be narrower)."""
        window = params.settings.mask_window
        check(window >= params.block_length,
              f"mask_window ({window}) must cover a block (block_length {params.block_length})")

    def steady_pass(self, params: SamplingParams, logit_shift: int) -> tuple[int, bool]:
        return params.settings.mask_window + params.settings.tracking_budget, True

    def initial_state(self, length: int, device: torch.device) -> FlashCacheState:
        return FlashCacheState(key_mass=torch.zeros(length, device=device),
                               decoded_at=torch.full((length,), -1, dtype=torch.long, device=device))

    def plan(self, runner: ModelRunner, batch: DecodeBatch) -> StepPlan:
        """The draft pass's query rows: every position at a row's first pass, then the budget."""
        settings = batch.params.settings
        budget = settings.mask_window + settings.tracking_budget
        counts = tuple(row.length if row.is_first_pass else
                       min(budget, row.length - (row.prompt_length if row.params.routes_prompt else 0))
                       for row in batch.rows)
        batch.count_query_rows(counts)
        return StepPlan(counts)

    def draft(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor,
              plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step's query rows through the cached forward. Returns logits [B, n, V] (model dtype) of the block
        columns (rows of the block that are not queries are decoded positions, whose logits are never used)
        and the query columns [B, Qmax] (ascending; the batch width where a row has fewer)."""
        device, counts = batch.tokens.device, list(plan.counts)
        width, lengths, max_q = batch.tokens.shape[1], batch.lengths, max(counts)
        shifted = runner.logit_sources if runner.logit_shift else None
        frozen = batch.frozen_prompt(runner.constant)
        chosen = torch.topk(query_priority(batch, shifted, frozen), max_q, dim=1).indices  # [B, Qmax]
        valid = torch.arange(max_q, device=device) < runner.constant(counts)[:, None]
        chosen = torch.where(valid, chosen, width).sort(dim=1).values                      # ascending, invalid last
        p = runner.prepare(batch, counts, chosen, track=runner.logit_sources(batch.tokens == batch.mask_id))
        key_mass = torch.zeros(len(counts), p.metadata.max_kv, device=device)
        hidden = runner.run(p, key_mass)

        # key_mass is indexed by position; store it by column for the next step's choice. Offsets past a row's
        # length add their 0 to its last column (a scatter without boolean indexing).
        max_kv = p.metadata.max_kv
        kv_columns = (width - lengths)[:, None] + torch.arange(max_kv, device=device)
        in_range = torch.arange(max_kv, device=device) < lengths[:, None]
        mass = torch.zeros_like(batch.state.key_mass)
        mass.scatter_add_(1, kv_columns.clamp(max=width - 1), torch.where(in_range, key_mass, 0.0))
        batch.state.key_mass.copy_(mass)
        return runner.logits(hidden, p.flat_of_column, columns), chosen

    def block_logits(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor,
                     plan: StepPlan) -> torch.Tensor:
        return self.draft(runner, batch, columns, plan)[0]

    def note_transfer(self, batch: DecodeBatch, columns: torch.Tensor, transfer: torch.Tensor):
        decoded_at = batch.state.decoded_at
        current = decoded_at.gather(1, columns)
        decoded_at.scatter_(1, columns, torch.where(transfer, batch.counters.steps[:, None], current))
