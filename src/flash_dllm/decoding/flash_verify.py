"""Flash-Verify: self-verified parallel decoding.

One iteration is a draft pass (a Flash-Cache step) and a verify pass. The draft splits the block's masked
positions into D (confidence >= eps, accepted now) and S (the rest, in descending confidence). The verify
pass recomputes, without writing the cache, the draft pass's tracked decoded positions and D (the context,
D with its drafted tokens), a DRAFT view of S (drafted tokens) and a MASK view of S (mask tokens), both
views at S's positions. Isolation, with i, j ranks in S:
    context rows see context and mask views, never drafts;
    draft row i sees context, drafts j <= i and masks j > i;
    mask row i sees context, drafts j < i and masks j >= i (never its own draft).
Candidate i is accepted if the mask view's argmax equals its draft and the mask view's confidence is at
least gamma ("sequential", stop at the first failure), or while the product of the mask views'
probabilities of the drafts stays at least gamma ("cumprod"). At least one token is decoded per iteration.

On an architecture with shifted logits (Dream: column j's logits from the hidden state of column j - 1) the
mask view of candidate i does not predict its own column. The pass then adds a PREDICT row per candidate: a
query of column p_i - 1 holding view i's token there (the context's token, draft k for a candidate k < i, the
mask for k > i) that sees what mask row i sees; no row sees it. Its hidden state gives candidate i's logits.
Column p_i - 1 is always in the pass (a context row or a view: the draft pass queried the window's left
neighbours), so the cache never shows it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import StepPlan, check, knob
from .flash_cache import FlashCache, SelectiveSettings
from .sampling import sample_tokens
from .transfer import confidence_ranks

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner

CONTEXT, DRAFT, MASK, PREDICT = 0, 1, 2, 3


def verify_visibility(role: torch.Tensor, rank: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """role, rank, valid [B, Q] (pass rows in padded order) -> [B, Q, Q]: query row sees key row. A PREDICT
    row sees what the mask row of its rank sees; no row sees a PREDICT row."""
    q_role, k_role = role[:, :, None], role[:, None, :]
    q_rank, k_rank = rank[:, :, None], rank[:, None, :]
    q_view = (q_role == MASK) | (q_role == PREDICT)
    sees_context = k_role == CONTEXT
    sees_mask = (k_role == MASK) & ((q_role == CONTEXT) | ((q_role == DRAFT) & (k_rank > q_rank))
                                    | (q_view & (k_rank >= q_rank)))
    sees_draft = (k_role == DRAFT) & (((q_role == DRAFT) & (k_rank <= q_rank)) | (q_view & (k_rank < q_rank)))
    return (sees_context | sees_mask | sees_draft) & valid[:, None, :]


def verify_entries(columns, valid, ids, role: int, rank) -> tuple[torch.Tensor, ...]:
    """One group of verify-pass entries [B, k]: columns, valid, token ids, role and rank (a tensor or 0)."""
    return columns, valid, ids, torch.full_like(columns, role), torch.zeros_like(columns) + rank


def compact_entries(keys: torch.Tensor, valid: torch.Tensor, *values: torch.Tensor):
    """Move each row's valid entries to the front, keeping their order."""
    order = torch.where(valid, torch.arange(valid.shape[1], device=valid.device), valid.shape[1]).argsort(dim=1)
    return [t.gather(1, order) for t in (keys, valid, *values)]


@dataclass(frozen=True)
class FlashVerifySettings(SelectiveSettings):
    verify_threshold: float = knob(0.8, "the mask view's confidence needed to accept a candidate", symbol="gamma")
    acceptance: str = knob("sequential", "sequential: candidates in order while each passes; cumprod: while the "
                                         "product of their probabilities stays >= verify_threshold",
                           symbol="acc", choices=("sequential", "cumprod"))

    def __post_init__(self):
        super().__post_init__()
        check(0 <= self.verify_threshold <= 1, f"verify_threshold must be in [0, 1], got {self.verify_threshold}")


class FlashVerify(FlashCache):
    name = "flash-verify"
    Settings = FlashVerifySettings

    replayable = False  # the verify pass's shape is read back in the middle of the step

    def transfer(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor, offsets: torch.Tensor,
                 plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft + verify iteration -> (candidate tokens [B, n], positions to unmask [B, n])."""
        draft_part = functools.partial(self.draft_and_entries, runner, batch, plan)
        if runner.uses_graphs(plan.rows):  # the step up to the verify pass's shape: one launch while the plan repeats
            drafted = runner.graphs.run(("flash-verify draft", batch.number, plan), draft_part, (columns, offsets))
        else:
            drafted = draft_part(columns, offsets)
        drafts, masked, confidence, accept_now, candidates, s_order, s_columns, s_valid, counts, *entries = drafted
        counts = counts.tolist()  # the verify pass's shape (a second host sync per iteration)
        transfer = accept_now
        if max(counts) > 0:
            transfer = transfer | self.verify(runner, batch, counts, *entries, drafts, s_order, s_columns, s_valid,
                                              candidates)
        stuck = ~transfer.any(dim=1, keepdim=True)                                     # decode at least one
        return drafts, transfer | (stuck & masked & (confidence_ranks(confidence) == 0))

    def draft_and_entries(self, runner: ModelRunner, batch: DecodeBatch, plan: StepPlan, columns: torch.Tensor,
                          offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The draft pass, its split into D and S, and the verify pass's entries, on the device (a function of the
        batch's tensors given the plan, which a CUDA graph replays). Returns the drafts, the block's masked
        positions, their confidences, D, S [B, n]; S by rank (order, columns, valid); the verify pass's row count
        per request [B]; and its entries [B, slots] (columns, valid, ids, role, rank, slot), valid ones first."""
        tokens, mask_id = batch.tokens, batch.mask_id
        device, width = tokens.device, tokens.shape[1]
        logits, draft_queries = self.draft(runner, batch, columns, plan)
        block = tokens.gather(1, columns)
        masked = block == mask_id
        drafts, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.counters.steps, offsets,
                                           sample=batch.is_sampling, mask_id=mask_id, kernels=runner.kernels)
        confidence = confidence.masked_fill(~masked, float("-inf"))
        accept_now = masked & (confidence >= batch.rule_value[:, None])              # D
        candidates = masked & ~accept_now                                             # S
        num_candidates = candidates.sum(dim=1)
        batch.counters.nfe += (num_candidates > 0).long()  # the verify pass, for the rows that have one

        # Pass rows per request: context (tracked decoded columns of the draft pass, then D), S drafts, S masks,
        # and on a shifted architecture the S predictors (the entries that give S's logits come last).
        safe_queries = draft_queries.clamp(max=width - 1)
        tracked = (draft_queries < width) & (tokens.gather(1, safe_queries) != mask_id)
        rank = confidence_ranks(confidence.masked_fill(~candidates, float("-inf")))   # S first, by confidence
        s_order = rank.argsort(dim=1)
        s_columns = columns.gather(1, s_order)                                        # [B, n] by rank
        n = columns.shape[1]
        s_valid = torch.arange(n, device=device) < num_candidates[:, None]
        by_rank = torch.arange(n, device=device).expand_as(s_columns)
        draft_ids, mask_ids = drafts.gather(1, s_order), torch.full_like(s_columns, mask_id)
        entries = [verify_entries(safe_queries, tracked, tokens.gather(1, safe_queries), CONTEXT, 0),
                   verify_entries(columns, accept_now, torch.where(accept_now, drafts, block), CONTEXT, 0),
                   verify_entries(s_columns, s_valid, draft_ids, DRAFT, by_rank),
                   verify_entries(s_columns, s_valid, mask_ids, MASK, by_rank)]
        if runner.logit_shift:
            source, view_ids = self.predictors(runner.logit_shift, tokens, columns, accept_now, drafts, s_columns,
                                               s_valid, draft_ids, by_rank)
            entries.append(verify_entries(source, s_valid, view_ids, PREDICT, by_rank))
        pass_columns, valid, ids, role, ranks = (torch.cat(part, dim=1) for part in zip(*entries))
        valid = valid & (num_candidates > 0)[:, None]
        slot = torch.arange(valid.shape[1], device=device).expand_as(valid)          # where each entry started
        entries = compact_entries(pass_columns, valid, ids, role, ranks, slot)
        return (drafts, masked, confidence, accept_now, candidates, s_order, s_columns, s_valid,
                entries[1].sum(dim=1), *entries)

    @staticmethod
    def predictors(shift, tokens, columns, accept_now, drafts, s_columns, s_valid, draft_ids, by_rank):
        """S's predictors by rank: their columns p_i - shift [B, n] and view i's token there [B, n]."""
        width = tokens.shape[1]
        context_ids = tokens.scatter(1, columns, torch.where(accept_now, drafts, tokens.gather(1, columns)))
        rank_of_column = torch.full_like(tokens, width).scatter(1, s_columns, torch.where(s_valid, by_rank, width))
        draft_of_column = tokens.scatter(1, s_columns, draft_ids)
        source = (s_columns - shift).clamp(min=0)  # a column of the generated region is never a row's first
        source_rank = rank_of_column.gather(1, source)
        view_ids = torch.where(source_rank < by_rank, draft_of_column.gather(1, source),   # an earlier candidate
                               torch.where(source_rank < width, tokens.gather(1, source), # a later one: its mask
                                           context_ids.gather(1, source)))
        return source, view_ids

    def verify(self, runner, batch, counts, columns, valid, ids, role, ranks, slot, drafts, s_order, s_columns,
               s_valid, candidates, block_size: int | None = None) -> torch.Tensor:
        """Run the verify pass; return the accepted candidates [B, n]. block_size: a block-causal model's, whose
        current block the pass's rows lie in (they attend up to its end)."""
        settings, device = batch.params.settings, columns.device
        num_slots, max_q = slot.shape[1], max(counts)
        columns, valid, ids, role, ranks, slot = (t[:, :max_q] for t in (columns, valid, ids, role, ranks, slot))
        # The valid entries lead each row (compacted), so the pass takes the first counts[b] of each.
        p = runner.prepare(batch, counts, columns, input_ids=ids, visibility=verify_visibility(role, ranks, valid),
                           block_size=block_size)
        batch.count_query_rows(counts)
        hidden = runner.run(p)

        # The flat row of each pass entry, by where the entry started; the last n entries (S's mask views, or its
        # predictors on a shifted architecture) give the logits of S's columns.
        n = s_order.shape[1]
        flat_index = torch.full((len(counts), num_slots), -1, dtype=torch.long, device=device)
        flat_index.scatter_(1, slot, torch.where(valid, valid.flatten().long().cumsum(0).view_as(valid) - 1, -1))
        logits = runner.logits_of(hidden, flat_index[:, num_slots - n:])             # [B, n] by rank
        probs = torch.softmax(logits.double(), dim=-1)
        mask_choice = probs.index_fill(-1, torch.full((1,), batch.mask_id, device=device), -1.0).argmax(dim=-1)
        draft_by_rank = drafts.gather(1, s_order)
        if settings.acceptance == "cumprod":
            ok = probs.gather(-1, draft_by_rank[..., None]).squeeze(-1).cumprod(dim=1) >= settings.verify_threshold
        else:
            ok = (mask_choice == draft_by_rank) & (
                probs.gather(-1, mask_choice[..., None]).squeeze(-1) >= settings.verify_threshold)
        accepted_by_rank = (ok & s_valid).long().cumprod(dim=1).bool()
        return torch.zeros_like(candidates).scatter(1, s_order, accepted_by_rank) & candidates
