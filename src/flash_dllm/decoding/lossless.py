"""Lossless draft-and-verify (FreeDave's idea): the tokens of one-token-per-step `reference` decoding with
fewer sequential forward passes.

Every iteration runs one batched forward over the current state T_0 = x and the hypothesised states
T_j = x + d_0 + ... + d_{j-1} (drafts carried from the previous iteration). From each state's logits the
reference rule gives the true next decision e_j (the most confident masked position of the current block,
its token drawn with step s + j's noise). While e_j == d_j, state T_{j+1} is exact; with m leading
matches, e_0 .. e_m are accepted: at least one token per iteration, each exactly as the reference would
decode it. New drafts come from the last exact state's logits, in the reference's own order (current
block by confidence, then the next block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import ATTENTION_KINDS
from .base import DecodingMethod, Settings, check, knob
from .sampling import NOISE_STREAM, gumbel_noise, sample_tokens
from .transfer import confidence_ranks

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..engine.model_runner import ModelRunner
    from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class LosslessSettings(Settings):
    draft_length: int = knob(4, "hypothesised steps verified per pass (at most block_length)", symbol="draft")


@dataclass
class LosslessState:
    draft_rank: torch.Tensor   # long: the position's rank among the carried drafts; -1 for none
    draft_token: torch.Tensor  # long: its drafted token


class Lossless(DecodingMethod):
    name = "lossless"
    handles_logit_shift = True  # full forwards: the runner's full_logits applies the shift
    attention_patterns = ATTENTION_KINDS  # full forwards, under the model's pattern
    Settings = LosslessSettings

    def validate(self, params: SamplingParams):
        check(0 < params.settings.draft_length <= params.block_length,
              f"draft_length must be in [1, block_length], got {params.settings.draft_length}")

    def initial_state(self, length: int, device: torch.device) -> LosslessState:
        return LosslessState(draft_rank=torch.full((length,), -1, dtype=torch.long, device=device),
                             draft_token=torch.zeros(length, dtype=torch.long, device=device))

    def step(self, runner: ModelRunner, batch: DecodeBatch):
        lossless_step(runner, batch)


def lossless_step(runner: ModelRunner, batch: DecodeBatch):
    params, tokens, mask_id, counters = batch.params, batch.tokens, batch.mask_id, batch.counters
    device, B = tokens.device, tokens.shape[0]
    k, n, num_blocks = params.settings.draft_length, params.block_length, params.num_blocks
    rank, draft_token = batch.state.draft_rank, batch.state.draft_token

    # the carried drafts by rank [B, k]: column, token, valid
    order = torch.where(rank >= 0, rank, k).argsort(dim=1)[:, :k]
    draft_valid = rank.gather(1, order) >= 0
    draft_columns, draft_tokens = order, draft_token.gather(1, order)

    # states T_0 .. T_k (T_j applies drafts 0 .. j-1), computed only where their drafts exist
    states = [tokens]
    for j in range(k):
        applied, take = states[-1].clone(), draft_valid[:, j]
        applied[take, draft_columns[take, j]] = draft_tokens[take, j]
        states.append(applied)
    state_valid = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=device), draft_valid], dim=1)
    flat = torch.stack(states, dim=1)[state_valid]                                   # [S, W]
    batch.count_query_rows([n * row.length for n, row in zip(state_valid.sum(dim=1).tolist(), batch.rows)])
    row = torch.arange(B, device=device)[:, None].expand(B, k + 1)[state_valid]      # request of each state
    index = torch.arange(k + 1, device=device).expand(B, k + 1)[state_valid]        # its j

    # logits of each state's current and next block
    block = counters.block_index.clamp(max=num_blocks - 1)[row]
    offsets = block[:, None] * n + torch.arange(2 * n, device=device)
    exists = offsets < params.max_tokens                # the last block has no next, and may end early
    offsets = offsets.clamp(max=params.max_tokens - 1)  # in range; never a candidate
    columns = batch.gen_start + offsets
    # The decisions need a state's logits only through its tokens and confidences, so they are taken group by group
    # of states (5 states x 32 requests x 2 blocks x LLaDA's vocabulary in fp32: 5 GB); sampling keeps the logits for
    # the new drafts' tokens.
    temperature, seed, state_step = batch.temperature[row], batch.seed[row], counters.steps[row] + index
    candidates, confidence, kept = [], [], None
    for g, logits in runner.full_logits_in_groups(flat, batch.positions[row], batch.attention_mask[row], columns):
        group_tokens, group_confidence = sample_tokens(logits, temperature[g], seed[g], state_step[g], offsets[g],
                                                       sample=batch.is_sampling, mask_id=mask_id,
                                                       kernels=runner.kernels)
        candidates.append(group_tokens)
        confidence.append(group_confidence)
        if batch.is_sampling:
            kept = logits.new_empty(flat.shape[0], *logits.shape[1:]) if kept is None else kept
            kept[g] = logits
    candidates, confidence = torch.cat(candidates), torch.cat(confidence)
    masked = (flat.gather(1, columns) == mask_id) & exists
    current = torch.arange(2 * n, device=device) < n
    in_current = (masked & current).any(dim=1, keepdim=True)
    confidence = confidence.masked_fill(~(masked & (current == in_current)), float("-inf"))

    # the reference's decision from each state, against the drafts
    best = confidence.argmax(dim=1, keepdim=True)
    decision_col = torch.full((B, k + 1), -1, dtype=torch.long, device=device)
    decision_tok = torch.zeros((B, k + 1), dtype=torch.long, device=device)
    decided = torch.zeros((B, k + 1), dtype=torch.bool, device=device)
    decision_col[row, index] = columns.gather(1, best).squeeze(1)
    decision_tok[row, index] = candidates.gather(1, best).squeeze(1)
    decided[row, index] = masked.any(dim=1)
    matches = (decision_col[:, :k] == draft_columns) & (decision_tok[:, :k] == draft_tokens) & draft_valid
    m = matches.long().cumprod(dim=1).sum(dim=1)                                     # [B] leading matches
    accepted = (torch.arange(k + 1, device=device) <= m[:, None]) & decided          # e_0 .. e_m
    for j in range(k + 1):
        take = accepted[:, j]
        tokens[take, decision_col[take, j]] = decision_tok[take, j]

    # new drafts from T_m, after its own decision: its current block by confidence, then the next block
    source = torch.zeros(B, dtype=torch.long, device=device)
    source[row[index == m[row]]] = torch.nonzero(index == m[row]).squeeze(1)
    after = masked[source] & (columns[source] != decision_col.gather(1, m[:, None]))
    priority = torch.where(after, torch.where(current, 2.0, 0.0) + confidence[source].clamp(min=-1.0), float("-inf"))
    draft_rank = confidence_ranks(priority)
    chosen = (draft_rank < k) & after
    num_accepted = accepted.sum(dim=1)
    new_tokens = candidates[source]
    if batch.is_sampling:  # each draft's token under the noise of the step it would be decided at
        steps = counters.steps + num_accepted
        noise = gumbel_noise(batch.seed.repeat_interleave(2 * n), (steps[:, None] + draft_rank).flatten(),
                             offsets[source].flatten()[:, None], NOISE_STREAM, kept.shape[-1])[:, 0]
        scores = kept[source].double().flatten(0, 1) + (
            batch.temperature.repeat_interleave(2 * n)[:, None].double() * noise)
        scores[:, mask_id] = float("-inf")
        new_tokens = scores.argmax(dim=-1).view(B, 2 * n)
    rank.fill_(-1)
    requests = torch.arange(B, device=device)[:, None].expand_as(chosen)
    rank[requests[chosen], columns[source][chosen]] = draft_rank[chosen]
    draft_token[requests[chosen], columns[source][chosen]] = new_tokens[chosen]

    counters.steps += num_accepted
    counters.nfe += 1
    block_of_offset = torch.arange(params.max_tokens, device=device) // n
    still_masked = tokens[:, batch.gen_start:] == mask_id
    counters.block_index = torch.where(still_masked, block_of_offset, num_blocks).amin(dim=1)
