"""Routing of a long prompt's KV (issue 17): each step, per layer, request and KV head, only the prompt's key
chunks that the step's queries may need are read; the generated part stays dense.

The prompt's positions are cut into chunks of CHUNK keys. Each step scores a request's chunks with all of its
query rows and all query heads of a KV head (one routing shared by the step's rows), and opens the top chunks
within its budget, plus the attention sinks (the first SINKS positions) and a recent window (the prompt's last
WINDOW positions), which are always open. Policies (`SamplingParams.kv_routing`):
    chunk     a chunk's score is the upper bound of any of its keys' scores (per-dimension min/max, as Quest
              scores pages): sum_d max(q_d * lo_d, q_d * hi_d), the largest over rows and heads;
    centroid  its mean key's score;
    window    the chunks nearest the prompt's end (a control: recency alone);
    random    a fixed pseudo-random order per (layer, KV head, chunk) (a control at equal bytes).
A request's budget (`kv_budget`, a fraction of its prompt's keys) counts the sinks and the window. The pass's
rows in the prompt itself (a full pass's, Flash-Cache's tracked prompt positions) read every key: their keys
are rewritten from them, and routed they would drift from the prompt's meaning (measured: passkey retrieval
fails with Flash-Cache when they are routed); a pass with such rows counts as reading the prompt in full.

This is the PyTorch reference of the routing: the chunks' summaries are taken from the cache at every step
(a later kernel keeps them beside the cache, written with the prompt, and reads only the open chunks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention_metadata import padded_index

CHUNK, SINKS, WINDOW = 32, 4, 32
POLICIES = ("chunk", "centroid", "window", "random")


@dataclass
class PromptRouting:
    """Per request of a pass: which keys of its cache range are its prompt, how many chunks it opens and how they
    are scored; also where the keys each step reads are counted. Requests without routing open every chunk."""

    prompt_len: torch.Tensor   # [B] long: keys [0, prompt_len) of the request's cache range are routed
    top_k: torch.Tensor        # [B] long: chunks opened besides the sinks and the window
    policy: torch.Tensor       # [B] long: index into POLICIES, -1 = dense
    max_top_k: int             # the largest top_k (a host number: the top-k's width)
    dense_rows: torch.Tensor   # [N] bool: the pass's rows in a prompt (they read every key: their own keys
                               # are rewritten from them)
    pure: torch.Tensor         # [B] bool: the pass has no prompt row of the request (it reads its prompt routed)
    batch_row: torch.Tensor    # [B] long: each request's row of the decode batch (the accumulators' index)
    keys_read: torch.Tensor    # [batch rows] long: prompt keys read, summed over passes, layers and KV heads
    keys_dense: torch.Tensor   # [batch rows] long: the same, had every prompt key been read

    @classmethod
    def build(cls, prompt_lens: list[int], budgets: list[float], policies: list[str | None],
              row_request: torch.Tensor, positions: torch.Tensor, batch_row: torch.Tensor, keys_read: torch.Tensor,
              keys_dense: torch.Tensor, constant) -> PromptRouting:
        """row_request, positions [N]: each query row's request and position. `constant`: host list -> device
        tensor (the runner's, which keeps repeating lists on the device)."""
        top_k = [chunks_opened(length, budget) if policy else 0
                 for length, budget, policy in zip(prompt_lens, budgets, policies)]
        prompt_len = constant(prompt_lens)
        dense_rows = positions < prompt_len[row_request]
        prompt_rows = torch.zeros_like(prompt_len).index_add_(0, row_request, dense_rows.long())
        return cls(prompt_len, constant(top_k), constant([POLICIES.index(p) if p else -1 for p in policies]),
                   max(top_k), dense_rows, prompt_rows == 0, batch_row, keys_read, keys_dense)


def chunks_opened(prompt_len: int, budget: float) -> int:
    """Chunks a request opens besides its sinks and window: its budget of keys, less those, in whole chunks (a
    budget of 1: every chunk, the dense attention)."""
    if budget >= 1:
        return -(-prompt_len // CHUNK)
    always = min(prompt_len, SINKS + WINDOW)
    return max(0, (int(budget * prompt_len) - always) // CHUNK)


def route(q: torch.Tensor, k_cache: torch.Tensor, metadata, layer: int) -> torch.Tensor:
    """q [N, H, D] a pass's rotated queries, k_cache [rows, Hkv, D] the layer's cache (already holding the
    pass's keys) -> [B, Hkv, max_kv] bool: the cache keys each request's KV head reads (`visible_keys`)."""
    key_index, key_valid = padded_index(metadata.kv_start, metadata.kv_len, metadata.max_kv)
    q_begin = metadata.cu_seqlens_q[:-1]
    q_index, q_valid = padded_index(q_begin, metadata.cu_seqlens_q[1:] - q_begin, metadata.max_q)
    return visible_keys(q, k_cache[key_index], key_valid, q_index.clamp(max=q.shape[0] - 1), q_valid,
                        metadata.routing, layer)


def visible_keys(q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor, q_index: torch.Tensor,
                q_valid: torch.Tensor, routing: PromptRouting, layer: int) -> torch.Tensor:
    """q [N, H, D] the pass's rotated queries; keys [B, K, Hkv, D] each request's cache range (padded to K),
    key_valid [B, K]; q_index, q_valid [B, Q]: each request's rows of q -> [B, Hkv, K] bool: the keys each
    request's KV head reads this step (all of the generated part; of the prompt, the open chunks, the sinks
    and the window). Adds the prompt keys read to routing.keys_read."""
    B, K, Hkv, D = keys.shape
    H = q.shape[1]
    group = H // Hkv
    positions = torch.arange(K, device=keys.device)
    in_prompt = (positions < routing.prompt_len[:, None]) & key_valid                       # [B, K]
    C = -(-K // CHUNK)
    pad = C * CHUNK - K
    chunked = F.pad(keys.float(), (0, 0, 0, 0, 0, pad)).view(B, C, CHUNK, Hkv, D)
    member = F.pad(in_prompt, (0, pad)).view(B, C, CHUNK, 1, 1)
    count = member.sum(dim=2)                                                               # [B, C, 1, 1]
    rows = q[q_index].float().masked_fill(~q_valid[:, :, None, None], 0.0)                 # [B, Q, H, D]
    rows = rows.view(B, -1, Hkv, group, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)  # [B, Hkv, Q*g, D]
    upper = torch.where(member, chunked, float("-inf")).amax(dim=2).permute(0, 2, 1, 3)   # [B, Hkv, C, D]
    lower = torch.where(member, chunked, float("inf")).amin(dim=2).permute(0, 2, 1, 3)
    finite = lambda t: torch.where(count.permute(0, 2, 1, 3) > 0, t, 0.0)
    bound = (rows.clamp(min=0) @ finite(upper).transpose(-1, -2)
             + rows.clamp(max=0) @ finite(lower).transpose(-1, -2))                          # [B, Hkv, Q*g, C]
    mean = (torch.where(member, chunked, 0.0).sum(dim=2) / count.clamp(min=1)).permute(0, 2, 1, 3)
    centroid = rows @ mean.transpose(-1, -2)
    row_valid = q_valid[:, None, :, None].expand(B, 1, -1, group).reshape(B, 1, -1, 1)
    best = lambda s: s.masked_fill(~row_valid, float("-inf")).amax(dim=2)                  # [B, Hkv, C]
    chunk_index = torch.arange(C, device=keys.device, dtype=torch.float32)
    head = torch.arange(Hkv, device=keys.device)[:, None]
    shuffled = ((chunk_index.long() * 1103515245 + head * 12345 + layer * 2654435761) % 2147483647).float()
    policy = routing.policy.clamp(min=0)[:, None, None]
    scores = torch.stack([best(bound), best(centroid), chunk_index.expand(B, Hkv, C),
                          shuffled.expand(B, Hkv, C)]).gather(0, policy[None].expand(1, B, Hkv, C))[0]
    # Only chunks that hold keys of the prompt outside the sinks and the window compete.
    routable = in_prompt & (positions >= SINKS) & (positions < routing.prompt_len[:, None] - WINDOW)
    competes = F.pad(routable, (0, pad)).view(B, C, CHUNK).any(dim=2)                       # [B, C]
    scores = scores.masked_fill(~competes[:, None, :], float("-inf"))
    width = min(max(routing.max_top_k, 1), C)
    top = scores.topk(width, dim=-1)
    take = (torch.arange(width, device=keys.device) < routing.top_k[:, None, None]) & (top.values > float("-inf"))
    opened = torch.zeros(B, Hkv, C, dtype=torch.bool, device=keys.device).scatter_(-1, top.indices, take)
    chunk_of = (positions // CHUNK).expand(B, Hkv, K)
    visible = opened.gather(-1, chunk_of) & routable[:, None, :]
    always = (~in_prompt | (positions < SINKS) | (positions >= routing.prompt_len[:, None] - WINDOW))[:, None, :]
    visible = (visible | always) & key_valid[:, None, :]
    visible = visible | ((routing.policy < 0)[:, None, None] & key_valid[:, None, :])
    # A pass with prompt rows loads every key for them (counted as read in full).
    dense_count = in_prompt.sum(dim=1) * Hkv
    read = torch.where(routing.pure, (visible & in_prompt[:, None, :]).sum(dim=(1, 2)), dense_count)
    routing.keys_read.index_add_(0, routing.batch_row, read)
    routing.keys_dense.index_add_(0, routing.batch_row, dense_count)
    return visible
