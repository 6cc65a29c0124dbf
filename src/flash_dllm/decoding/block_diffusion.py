"""Block diffusion on a block-causal model (LLaDA2.x): the exact block cache, with LLaDA2.0's threshold sampler
(`parallel` on such a model) and LLaDA2.1's Draft-and-Edit (`edit`).

The model's blocks are aligned from position 0 and a position attends to its own block and the ones before, so a
finished block's K/V never change. A sequence is decoded from the block that holds its prompt's end (the prompt
tokens there are fixed inputs) to the block that holds its last generated position, decoded whole: the positions
after the generation are masks like the others and are dropped (`tail_tokens`). Each step's pass computes the
current block's rows only, against the cache of every earlier block; the step after a block ends also writes that
block's K/V from its final tokens (one more group of rows in the same pass), and the first step writes the prompt's
whole blocks, each group of rows attending up to its own block's end. The published generate() re-runs the whole
prefix every step: the same tokens, for a block's work. Under kv_routing, the passes without prompt rows (the blocks
after the one that holds the prompt's end) read the prompt's routed chunks (cache/routing.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from .base import DecodingMethod, Settings, StepPlan, check, knob
from .flash_cache import FlashCacheSettings, FlashCacheState
from .flash_verify import CONTEXT, DRAFT, MASK, FlashVerify, FlashVerifySettings, compact_entries, verify_entries
from .parallel import ParallelSettings
from .sampling import sample_tokens
from .transfer import confidence_ranks, linear_schedule, transfer_top_k

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..config import ModelConfig
    from ..engine.model_runner import ModelRunner
    from ..sampling_params import SamplingParams

# A group of a step's pass: (its batch row, "prompt" | "commit" | "current", the block's first position for a
# prompt block).
PROMPT, COMMIT, CURRENT = "prompt", "commit", "current"


class BlockPass(NamedTuple):
    """A step's pass as the current block sees it, each [B, block_length]: its columns, tokens, which are past the
    prompt, the candidates and their confidences (float64), and the columns of the current block's query rows (the
    first `current_rows` of each)."""
    block_columns: torch.Tensor
    block: torch.Tensor
    generated: torch.Tensor
    candidates: torch.Tensor
    confidence: torch.Tensor
    queries: torch.Tensor


class BlockDiffusion(DecodingMethod):
    """The exact block cache of a block-causal model; subclasses give the rule (`transfer`)."""

    uses_cache = True
    replayable = True
    attention_patterns = ("block-causal",)

    def check_model(self, config: ModelConfig, params: SamplingParams):
        block = config.attention.block_size
        check(params.block_length == block, f"block_length must be {block} on this model (its attention's blocks), "
                                            f"got {params.block_length}")
        check(params.kv_routing != "kmeans", "kv_routing 'kmeans' lays a prompt's keys out region by region when a "
                                             "pass writes its whole sequence, which a block-causal model never does "
                                             "(it writes block by block): use chunk, centroid, window or random")

    def tail_tokens(self, params: SamplingParams) -> int:
        return params.block_length  # at most a block's positions past the generation: the same for every row

    def steady_pass(self, params: SamplingParams, logit_shift: int) -> tuple[int, bool]:
        """The steps inside a block: the current block's rows alone (a serve captures their graphs before ready)."""
        return params.block_length, self.tracks_attention

    def plan(self, runner: ModelRunner, batch: DecodeBatch) -> StepPlan:
        """Per row: its prompt's whole blocks at its first step, the block that ended at its last step, and its
        current block; each a group of block_length rows."""
        size = batch.params.block_length
        groups, counts, per_row = [], [], []
        for b, row in enumerate(batch.rows):
            mine = [(b, CURRENT, 0)]
            if row.is_first_pass:
                mine = [(b, PROMPT, j * size) for j in range(row.prompt_length // size)] + mine
            elif row.step_in_block == 0:
                mine = [(b, COMMIT, 0)] + mine
            groups += mine
            counts += [size] * (len(mine) - 1) + [self.current_rows(batch, row)]
            per_row.append(size * (len(mine) - 1) + counts[-1])
        batch.count_query_rows(per_row)
        return StepPlan(tuple(counts), tuple(groups))

    def current_rows(self, batch: DecodeBatch, row) -> int:
        """Query rows of a row's current block this step (its first `block_queries`)."""
        return batch.params.block_length

    def block_queries(self, runner: ModelRunner, batch: DecodeBatch, block_columns: torch.Tensor,
                      plan: StepPlan) -> torch.Tensor:
        """[B, block_length] the current block's columns in the order its query rows take them."""
        return block_columns

    tracks_attention = False  # the step accumulates the attention mass its masked queries give each key

    def note_transfer(self, batch: DecodeBatch, block_columns: torch.Tensor, fill: torch.Tensor):
        """Per-position bookkeeping of what this step changed (before the tokens change)."""

    def run(self, runner: ModelRunner, batch: DecodeBatch, plan: StepPlan):
        drafted = self.forward_block(runner, batch, plan)
        changed, block_done = self.transfer(batch, drafted.block, drafted.candidates, drafted.confidence,
                                            drafted.generated)
        self.finish_step(batch, drafted, changed, block_done)

    def forward_block(self, runner: ModelRunner, batch: DecodeBatch, plan: StepPlan) -> BlockPass:
        """The step's pass, and the current block's candidates."""
        size, groups = batch.params.block_length, plan.extra
        width = batch.tokens.shape[1]
        first_column = width - batch.lengths  # [B] the column of position 0
        prompt = runner.constant([row.prompt_length for row in batch.rows])
        start = (prompt // size + batch.counters.block_index) * size  # [B] the current block's first position
        offsets = torch.arange(size, device=start.device)
        positions = start[:, None] + offsets  # [B, size] the current block
        block_columns = first_column[:, None] + positions
        order = [b for b, _, _ in groups]
        order_t = runner.constant(order)
        shift = runner.constant([-size if kind == COMMIT else 0 for _, kind, _ in groups])
        fixed = runner.constant([position if kind == PROMPT else -1 for _, kind, position in groups])
        current = runner.constant([kind == CURRENT for _, kind, _ in groups]).bool()
        group_start = torch.where(fixed >= 0, fixed, start[order_t] + shift)
        columns = torch.where(current[:, None], self.block_queries(runner, batch, block_columns, plan)[order_t],
                              (first_column[order_t] + group_start)[:, None] + offsets)
        masked = batch.tokens == batch.mask_id
        p = runner.prepare(batch, list(plan.counts), columns, order=order, block_size=size,
                           track=masked if self.tracks_attention else None)
        key_mass = torch.zeros(len(groups), p.metadata.max_kv, device=start.device) if self.tracks_attention else None
        hidden = runner.run(p, key_mass)
        if key_mass is not None:
            self.store_key_mass(batch, torch.zeros_like(key_mass[:len(batch.rows)]).index_add_(0, order_t, key_mass))
        logits = runner.logits(hidden, p.flat_of_column, block_columns)
        generated = positions - prompt[:, None]
        candidates, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.counters.steps,
                                               generated.clamp(min=0), sample=batch.is_sampling,
                                               mask_id=batch.mask_id, kernels=runner.kernels)
        queries = columns[runner.constant([g for g, (_, kind, _) in enumerate(groups) if kind == CURRENT])]
        return BlockPass(block_columns, batch.tokens.gather(1, block_columns), generated >= 0, candidates,
                         confidence, queries)

    def finish_step(self, batch: DecodeBatch, drafted: BlockPass, changed: torch.Tensor, block_done: torch.Tensor):
        """Write the changed tokens and advance the counters (one forward pass)."""
        self.note_transfer(batch, drafted.block_columns, changed)
        batch.tokens.scatter_(1, drafted.block_columns, torch.where(changed, drafted.candidates, drafted.block))
        counters = batch.counters
        counters.nfe += 1
        counters.steps += 1
        counters.block_index += block_done.long()
        counters.step_in_block.copy_(torch.where(block_done, 0, counters.step_in_block + 1))

    def store_key_mass(self, batch: DecodeBatch, key_mass: torch.Tensor):
        """key_mass [B, max_kv] by position -> the state's by column (positions past a row's length add their 0 to
        its last column: a scatter without boolean indexing)."""
        width, lengths = batch.tokens.shape[1], batch.lengths
        offsets = torch.arange(key_mass.shape[1], device=key_mass.device)
        kv_columns = ((width - lengths)[:, None] + offsets).clamp(max=width - 1)
        mass = torch.zeros_like(batch.state.key_mass)
        mass.scatter_add_(1, kv_columns, torch.where(offsets < lengths[:, None], key_mass, 0.0))
        batch.state.key_mass.copy_(mass)

    def transfer(self, batch: DecodeBatch, block: torch.Tensor, candidates: torch.Tensor, confidence: torch.Tensor,
                 generated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block [B, n] the current block's tokens, candidates and confidence [B, n] (float64), generated [B, n]
        True past the prompt -> (the positions that take their candidate [B, n], whether the block ended [B])."""
        raise NotImplementedError


class LLaDA2Threshold(BlockDiffusion):
    """LLaDA2.0's sampler: per step a quota of the block (its published steps rule: min(block_length, max_tokens)
    steps, the block spread evenly over them, the first ones one more); every mask whose confidence is strictly
    above `threshold` is filled if they are at least the quota, else the quota's most confident."""

    name = "parallel"
    Settings = ParallelSettings

    def check_model(self, config: ModelConfig, params: SamplingParams):
        super().check_model(config, params)
        check(getattr(params.settings, "factor", None) is None,
              f"factor is not LLaDA2's rule: method {self.name!r} on a block-causal model fills by threshold (drop "
              f"factor)")

    def transfer(self, batch, block, candidates, confidence, generated):
        params = batch.params
        masked = block == batch.mask_id
        steps = min(params.block_length, params.max_tokens)
        quota = linear_schedule(torch.full_like(batch.counters.steps, params.block_length),
                                torch.full_like(batch.counters.steps, steps), batch.counters.step_in_block)
        confidence = confidence.masked_fill(~masked, float("-inf"))
        above = masked & (confidence > batch.rule_value[:, None])
        fill = torch.where((above.sum(dim=1) >= quota)[:, None], above, transfer_top_k(confidence, masked, quota))
        return fill, ~(masked & ~fill).any(dim=1)


@dataclass(frozen=True)
class EditSettings(Settings):
    threshold: float = knob(0.95, "confidence in [0, 1] strictly above which a mask is filled (at least one per "
                                  "forward)", symbol="thr")
    edit_threshold: float = knob(0.9, "confidence in [0, 1] strictly above which a filled token of the block is "
                                      "rewritten to a different argmax", symbol="edit")
    max_post_steps: int = knob(16, "forwards of a mask-free block that may still edit it (0: none)",
                               symbol="post")
    per_row = ("threshold",)

    def __post_init__(self):
        super().__post_init__()
        check(0 <= self.threshold <= 1, f"threshold must be in [0, 1], got {self.threshold}")
        check(0 <= self.edit_threshold <= 1, f"edit_threshold must be in [0, 1], got {self.edit_threshold}")
        check(0 <= self.max_post_steps <= 1024, f"max_post_steps must be in [0, 1024], got {self.max_post_steps}")

    @property
    def rule_value(self) -> float:
        return self.threshold


class DraftAndEdit(BlockDiffusion):
    """LLaDA2.1's Draft-and-Edit: each forward fills the masks above `threshold` (at least the most confident one)
    and, in the same forward, rewrites the block's filled non-prompt tokens whose argmax now differs with
    confidence above `edit_threshold`. A block ends after a forward that began without a mask and proposed no edit,
    or after `max_post_steps` such forwards (with 0, when its last mask is filled). Until then its tokens may
    change: a row finishes only on the blocks that ended."""

    name = "edit"
    Settings = EditSettings
    demo_variants = {"edit": {}, "edit-quality": {"threshold": 0.7, "edit_threshold": 0.5},
                     "edit-speed": {"threshold": 0.5, "edit_threshold": 0.0}}

    def transfer(self, batch, block, candidates, confidence, generated):
        settings, counters = batch.params.settings, batch.counters
        masked = block == batch.mask_id
        had_masks = masked.any(dim=1)
        ranked = confidence.masked_fill(~masked, float("-inf"))
        above = masked & (ranked > batch.rule_value[:, None])
        fill = torch.where(above.any(dim=1)[:, None], above, transfer_top_k(ranked, masked, torch.ones_like(
            counters.steps)))
        edit = ~masked & generated & (candidates != block) & (confidence > settings.edit_threshold)
        mask_free = counters.mask_free_steps + (~had_masks).long()
        last_filled = had_masks & ~(masked & ~fill).any(dim=1) & (settings.max_post_steps == 0)
        confirmed = ~had_masks & (~edit.any(dim=1) | (mask_free >= settings.max_post_steps))
        block_done = last_filled | confirmed
        counters.mask_free_steps.copy_(torch.where(block_done, 0, mask_free))
        return fill | edit, block_done

    def editable(self, batch: DecodeBatch) -> torch.Tensor:
        """The generated positions from each row's current block on (those before it are final)."""
        start = batch.gen_start - (batch.tokens.shape[1] - batch.lengths)  # [B] the prompt length
        size = batch.params.block_length
        current = (start // size + batch.counters.block_index) * size - start
        return torch.arange(batch.params.max_tokens, device=start.device) >= current[:, None]


class BlockFlashCache(LLaDA2Threshold):
    """Flash-Cache's selective update inside the current block, with LLaDA2.0's rule: a block's first step computes
    all of it; its later steps compute min(mask_window + tracking_budget, block_length) of its positions (the
    window of its mask_window leftmost masks, then its decoded positions: last step's new tokens first, then by the
    attention mass the masks gave them last step) and read the rest of the block from the cache. Only the
    window's masks are unmasked. The blocks before stay exact (a block's K/V are rewritten from its final tokens
    when it ends), so with a window that covers the block this is `parallel` (the exact block cache)."""

    name = "flash-cache"
    Settings = FlashCacheSettings
    tracks_attention = True

    def initial_state(self, length: int, device: torch.device) -> FlashCacheState:
        return FlashCacheState(key_mass=torch.zeros(length, device=device),
                               decoded_at=torch.full((length,), -1, dtype=torch.long, device=device))

    def current_rows(self, batch: DecodeBatch, row) -> int:
        return batch.params.block_length if row.step_in_block == 0 else self.budget_rows(batch.params)

    @staticmethod
    def budget_rows(params: SamplingParams) -> int:
        """A block's later steps: its window's and tracking budget's rows, at most the block."""
        return min(params.settings.mask_window + params.settings.tracking_budget, params.block_length)

    def steady_pass(self, params: SamplingParams, logit_shift: int) -> tuple[int, bool]:
        return self.budget_rows(params), True

    def block_queries(self, runner: ModelRunner, batch: DecodeBatch, block_columns: torch.Tensor,
                      plan: StepPlan) -> torch.Tensor:
        """[B, block_length] the block's columns, those the current group computes first (a row whose count is
        the whole block computes all)."""
        settings, state = batch.params.settings, batch.state
        block = batch.tokens.gather(1, block_columns)
        masked = block == batch.mask_id
        window = masked & (masked.cumsum(dim=1) <= settings.mask_window)
        newly = ~masked & (state.decoded_at.gather(1, block_columns) == (batch.counters.steps - 1)[:, None])
        mass = state.key_mass.gather(1, block_columns)
        offsets = torch.arange(block.shape[1], device=block.device)
        relative_mass = mass / (mass.amax(dim=1, keepdim=True) + 1e-30)
        priority = torch.where(masked, 1.0 - offsets / block.shape[1], 2.0 + relative_mass)  # decoded above far masks
        priority = torch.where(window, 5.0, torch.where(newly, 3.5, priority))
        return block_columns.gather(1, priority.argsort(dim=1, descending=True, stable=True))

    def transfer(self, batch, block, candidates, confidence, generated):
        masked = block == batch.mask_id
        window = masked & (masked.cumsum(dim=1) <= batch.params.settings.mask_window)
        fill, _ = super().transfer(batch, torch.where(window, block, -1), candidates, confidence, generated)
        return fill, ~(masked & ~fill).any(dim=1)

    def note_transfer(self, batch: DecodeBatch, block_columns: torch.Tensor, fill: torch.Tensor):
        decoded_at = batch.state.decoded_at
        current = decoded_at.gather(1, block_columns)
        decoded_at.scatter_(1, block_columns, torch.where(fill, batch.counters.steps[:, None], current))


class BlockFlashVerify(BlockFlashCache):
    """Flash-Verify inside the current block: the draft is `flash-cache`'s pass; the window's masks strictly above
    `threshold` are accepted at once (D), the others (S) go to one more pass without cache writes over the draft
    pass's decoded query rows and D (the context), a draft view and a mask view of S under the isolation mask
    (decoding/flash_verify.py), every row attending up to the block's end; S is accepted in confidence order while
    the mask view agrees with the draft (or, `acceptance="cumprod"`, while the product of its probabilities holds),
    at least one token a step. The blocks before stay exact."""

    name = "flash-verify"
    Settings = FlashVerifySettings
    replayable = False  # the verify pass's shape is read back in the middle of the step

    def step(self, runner: ModelRunner, batch: DecodeBatch):
        plan = self.plan(runner, batch)
        drafted = self.forward_block(runner, batch, plan)
        tokens, mask_id, size = batch.tokens, batch.mask_id, batch.params.block_length
        block, drafts, columns = drafted.block, drafted.candidates, drafted.block_columns
        masked = block == mask_id
        window = masked & (masked.cumsum(dim=1) <= batch.params.settings.mask_window)
        confidence = drafted.confidence.masked_fill(~window, float("-inf"))
        accept_now = window & (confidence > batch.rule_value[:, None])                  # D
        candidates = window & ~accept_now                                               # S
        num_candidates = candidates.sum(dim=1)
        batch.counters.nfe += (num_candidates > 0).long()  # the verify pass, for the rows that have one

        offsets = torch.arange(size, device=tokens.device)
        current = runner.constant([self.current_rows(batch, row) for row in batch.rows])
        queries = drafted.queries
        query_ids = tokens.gather(1, queries)
        tracked = (offsets < current[:, None]) & (query_ids != mask_id)
        s_order = confidence_ranks(confidence.masked_fill(~candidates, float("-inf"))).argsort(dim=1)
        s_columns, s_valid = columns.gather(1, s_order), offsets < num_candidates[:, None]
        by_rank, draft_ids = offsets.expand_as(s_columns), drafts.gather(1, s_order)
        entries = [verify_entries(queries, tracked, query_ids, CONTEXT, 0),
                   verify_entries(columns, accept_now, torch.where(accept_now, drafts, block), CONTEXT, 0),
                   verify_entries(s_columns, s_valid, draft_ids, DRAFT, by_rank),
                   verify_entries(s_columns, s_valid, torch.full_like(s_columns, mask_id), MASK, by_rank)]
        pass_columns, valid, ids, role, ranks = (torch.cat(part, dim=1) for part in zip(*entries))
        valid = valid & (num_candidates > 0)[:, None]
        slot = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
        entries = compact_entries(pass_columns, valid, ids, role, ranks, slot)
        counts = entries[1].sum(dim=1).tolist()  # the verify pass's shape (a host sync)
        transfer = accept_now
        if max(counts) > 0:
            transfer = transfer | FlashVerify.verify(self, runner, batch, counts, *entries, drafts, s_order, s_columns,
                                                     s_valid, candidates, block_size=size)
        stuck = ~transfer.any(dim=1, keepdim=True)                                      # one token at least
        transfer = transfer | (stuck & window & (confidence_ranks(confidence) == 0))
        self.finish_step(batch, drafted, transfer, ~(masked & ~transfer).any(dim=1))
