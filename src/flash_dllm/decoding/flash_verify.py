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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cache.attention_metadata import device_tensor
from .base import check, knob
from .flash_cache import FlashCache, SelectiveSettings
from .sampling import sample_tokens
from .transfer import confidence_ranks

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner

CONTEXT, DRAFT, MASK = 0, 1, 2


def verify_visibility(role: torch.Tensor, rank: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """role, rank, valid [B, Q] (pass rows in padded order) -> [B, Q, Q]: query row sees key row."""
    q_role, k_role = role[:, :, None], role[:, None, :]
    q_rank, k_rank = rank[:, :, None], rank[:, None, :]
    sees_context = k_role == CONTEXT
    sees_mask = (k_role == MASK) & ((q_role == CONTEXT) | ((q_role == DRAFT) & (k_rank > q_rank))
                                    | ((q_role == MASK) & (k_rank >= q_rank)))
    sees_draft = (k_role == DRAFT) & (((q_role == DRAFT) & (k_rank <= q_rank)) | ((q_role == MASK) & (k_rank < q_rank)))
    return (sees_context | sees_mask | sees_draft) & valid[:, None, :]


def _compact(keys: torch.Tensor, valid: torch.Tensor, *values: torch.Tensor):
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

    def transfer(self, runner: ModelRunner, batch: DecodeBatch, columns: torch.Tensor,
                 offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft + verify iteration -> (candidate tokens [B, n], positions to unmask [B, n])."""
        tokens, mask_id = batch.tokens, batch.mask_id
        device, width = tokens.device, tokens.shape[1]
        logits, draft_queries = self.draft(runner, batch, columns)
        block = tokens.gather(1, columns)
        masked = block == mask_id
        drafts, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.counters.steps, offsets,
                                           sample=batch.is_sampling, mask_id=mask_id)
        confidence = confidence.masked_fill(~masked, float("-inf"))
        accept_now = masked & (confidence >= batch.rule_value[:, None])              # D
        candidates = masked & ~accept_now                                             # S
        num_candidates = candidates.sum(dim=1)
        batch.counters.nfe += (num_candidates > 0).long()  # the verify pass, for the rows that have one

        # Pass rows per request: context (tracked decoded columns of the draft pass, then D), S drafts, S masks.
        safe_queries = draft_queries.clamp(max=width - 1)
        tracked = (draft_queries < width) & (tokens.gather(1, safe_queries) != mask_id)
        rank = confidence_ranks(confidence.masked_fill(~candidates, float("-inf")))   # S first, by confidence
        s_order = rank.argsort(dim=1)
        s_columns = columns.gather(1, s_order)                                        # [B, n] by rank
        n = columns.shape[1]
        s_valid = torch.arange(n, device=device) < num_candidates[:, None]
        by_rank = torch.arange(n, device=device).expand_as(s_columns)
        pass_columns = torch.cat([safe_queries, columns, s_columns, s_columns], dim=1)
        valid = torch.cat([tracked, accept_now, s_valid, s_valid], dim=1) & (num_candidates > 0)[:, None]
        ids = torch.cat([tokens.gather(1, safe_queries), torch.where(accept_now, drafts, block),
                         drafts.gather(1, s_order), torch.full_like(s_columns, mask_id)], dim=1)
        role = torch.cat([torch.full_like(safe_queries, CONTEXT), torch.full_like(columns, CONTEXT),
                          torch.full_like(s_columns, DRAFT), torch.full_like(s_columns, MASK)], dim=1)
        ranks = torch.cat([torch.zeros_like(safe_queries), torch.zeros_like(columns), by_rank, by_rank], dim=1)
        slot = torch.arange(valid.shape[1], device=device).expand_as(valid)          # where each entry started
        pass_columns, valid, ids, role, ranks, slot = _compact(pass_columns, valid, ids, role, ranks, slot)
        counts = valid.sum(dim=1).tolist()  # the verify pass's shape (a second host sync per iteration)
        transfer = accept_now
        if max(counts) > 0:
            transfer = transfer | self.verify(runner, batch, counts, pass_columns, valid, ids, role, ranks, slot,
                                              drafts, s_order, s_columns, s_valid, candidates)
        stuck = ~transfer.any(dim=1, keepdim=True)                                     # decode at least one
        return drafts, transfer | (stuck & masked & (confidence_ranks(confidence) == 0))

    def verify(self, runner, batch, counts, columns, valid, ids, role, ranks, slot, drafts, s_order, s_columns,
               s_valid, candidates) -> torch.Tensor:
        """Run the verify pass; return the accepted candidates [B, n]."""
        settings, device = batch.params.settings, columns.device
        num_slots, max_q = slot.shape[1], max(counts)
        columns, valid, ids, role, ranks, slot = (t[:, :max_q] for t in (columns, valid, ids, role, ranks, slot))
        # The valid entries lead each row (compacted), so the pass takes the first counts[b] of each.
        p = runner.prepare(batch, counts, columns, input_ids=ids, visibility=verify_visibility(role, ranks, valid))
        batch.count_query_rows(counts)
        hidden = runner.run(p)

        # The flat row of each pass entry, by where the entry started; S's mask views started at the last n,
        # and give the logits of S's columns.
        n = s_order.shape[1]
        flat_index = torch.full((len(counts), num_slots), -1, dtype=torch.long, device=device)
        flat_index.scatter_(1, slot, torch.where(valid, valid.flatten().long().cumsum(0).view_as(valid) - 1, -1))
        mask_view_of_column = torch.full_like(batch.tokens, -1).scatter_(1, s_columns, flat_index[:, num_slots - n:])
        logits = runner.logits(hidden, mask_view_of_column, s_columns)                # [B, n] by rank
        probs = torch.softmax(logits.double(), dim=-1)
        mask_choice = probs.index_fill(-1, device_tensor([batch.mask_id], device), -1.0).argmax(dim=-1)
        draft_by_rank = drafts.gather(1, s_order)
        if settings.acceptance == "cumprod":
            ok = probs.gather(-1, draft_by_rank[..., None]).squeeze(-1).cumprod(dim=1) >= settings.verify_threshold
        else:
            ok = (mask_choice == draft_by_rank) & (
                probs.gather(-1, mask_choice[..., None]).squeeze(-1) >= settings.verify_threshold)
        accepted_by_rank = (ok & s_valid).long().cumprod(dim=1).bool()
        return torch.zeros_like(candidates).scatter(1, s_order, accepted_by_rank) & candidates
