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

Chunks are the cache's own (requests start at multiples of CHUNK rows, kv_cache.ALIGN). `route` is the
reference: it summarises the chunks from the cache at every step. `route_stored` reads the summaries kept beside
the cache (KVCache.chunk_summaries), which kernels/chunk_summaries.py rewrites for the chunks that a pass's
prompt rows write; the attention kernel then visits only the open chunks.
"""
from __future__ import annotations

import dataclasses
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
    row_request: torch.Tensor  # [N] long: each query row's request
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
                   max(top_k), row_request, dense_rows, prompt_rows == 0, batch_row, keys_read, keys_dense)


    def leading(self, groups: int, rows: int) -> PromptRouting:
        """The routing of a pass's first `groups` requests, which own its first `rows` query rows."""
        return dataclasses.replace(
            self, prompt_len=self.prompt_len[:groups], top_k=self.top_k[:groups], policy=self.policy[:groups],
            row_request=self.row_request[:rows], dense_rows=self.dense_rows[:rows], pure=self.pure[:groups],
            batch_row=self.batch_row[:groups])


def chunks_opened(prompt_len: int, budget: float) -> int:
    """Chunks a request opens besides its sinks and window: its budget of keys, less those, in whole chunks (a
    budget of 1: every chunk, the dense attention)."""
    if budget >= 1:
        return -(-prompt_len // CHUNK)
    always = min(prompt_len, SINKS + WINDOW)
    return max(0, (int(budget * prompt_len) - always) // CHUNK)


def route(q: torch.Tensor, k_cache: torch.Tensor, metadata, layer: int) -> torch.Tensor:
    """q [N, H, D] a pass's rotated queries, k_cache [rows, Hkv, D] the layer's cache (already holding the
    pass's keys) -> [B, Hkv, max_kv] bool: the cache keys each request's KV head reads (`visible_keys`), its
    chunks summarised from the cache."""
    key_index, key_valid = padded_index(metadata.kv_start, metadata.kv_len, metadata.max_kv)
    in_prompt = prompt_keys(key_valid, metadata.routing)
    return visible_keys(q, summarise(k_cache[key_index], in_prompt), key_valid, metadata, layer)


def route_stored(q: torch.Tensor, summaries: torch.Tensor, metadata, layer: int) -> torch.Tensor:
    """As `route`, with the chunk summaries kept beside the cache: summaries [cache rows / CHUNK, 3, Hkv, D]
    (the layer's KVCache.chunk_summaries, fresh for the pass's prompt rows). No prompt key is read."""
    key_valid = torch.arange(metadata.max_kv, device=q.device) < metadata.kv_len[:, None]
    chunk = metadata.kv_start[:, None] // CHUNK + torch.arange(-(-metadata.max_kv // CHUNK), device=q.device)
    return visible_keys(q, summaries[chunk.clamp(max=summaries.shape[0] - 1)].float(), key_valid, metadata, layer)


def prompt_keys(key_valid: torch.Tensor, routing: PromptRouting) -> torch.Tensor:
    """[B, K] bool: the keys of each request's range (key_valid [B, K]) that are its prompt's."""
    return (torch.arange(key_valid.shape[1], device=key_valid.device) < routing.prompt_len[:, None]) & key_valid


def summarise(keys: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """keys [B, K, Hkv, D], member [B, K] bool -> [B, C, 3, Hkv, D] fp32: per chunk of CHUNK keys, the lower
    bounds, upper bounds and mean of its member keys (zeros for a chunk with none)."""
    B, K, Hkv, D = keys.shape
    C = -(-K // CHUNK)
    pad = C * CHUNK - K
    chunked = F.pad(keys.float(), (0, 0, 0, 0, 0, pad)).view(B, C, CHUNK, Hkv, D)
    inside = F.pad(member, (0, pad)).view(B, C, CHUNK, 1, 1)
    count = inside.sum(dim=2)                                                               # [B, C, 1, 1]
    finite = lambda t: torch.where(count > 0, t, 0.0)
    lower = finite(torch.where(inside, chunked, float("inf")).amin(dim=2))
    upper = finite(torch.where(inside, chunked, float("-inf")).amax(dim=2))
    mean = torch.where(inside, chunked, 0.0).sum(dim=2) / count.clamp(min=1)
    return torch.stack([lower, upper, mean], dim=2)


def visible_keys(q: torch.Tensor, summaries: torch.Tensor, key_valid: torch.Tensor, metadata,
                 layer: int) -> torch.Tensor:
    """q [N, H, D] the pass's rotated queries; summaries [B, C, 3, Hkv, D] each request's chunks (`summarise`),
    key_valid [B, K] its cache range (padded to K = max_kv) -> [B, Hkv, K] bool: the keys each request's KV head
    reads this step (all of the generated part; of the prompt, the open chunks, the sinks and the window). Adds
    the prompt keys read to routing.keys_read."""
    routing = metadata.routing
    B, K = key_valid.shape
    C, Hkv, D = summaries.shape[1], summaries.shape[3], summaries.shape[4]
    group = q.shape[1] // Hkv
    q_begin = metadata.cu_seqlens_q[:-1]
    q_index, q_valid = padded_index(q_begin, metadata.cu_seqlens_q[1:] - q_begin, metadata.max_q)
    positions = torch.arange(K, device=q.device)
    in_prompt = prompt_keys(key_valid, routing)                                             # [B, K]
    pad = C * CHUNK - K
    rows = q[q_index.clamp(max=q.shape[0] - 1)].float().masked_fill(~q_valid[:, :, None, None], 0.0)
    rows = rows.view(B, -1, Hkv, group, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)  # [B, Hkv, Q*g, D]
    lower, upper, mean = summaries.permute(2, 0, 3, 1, 4)                                   # [B, Hkv, C, D] each
    bound = rows.clamp(min=0) @ upper.transpose(-1, -2) + rows.clamp(max=0) @ lower.transpose(-1, -2)
    centroid = rows @ mean.transpose(-1, -2)                                                # [B, Hkv, Q*g, C]
    row_valid = q_valid[:, None, :, None].expand(B, 1, -1, group).reshape(B, 1, -1, 1)
    best = lambda s: s.masked_fill(~row_valid, float("-inf")).amax(dim=2)                  # [B, Hkv, C]
    chunk_index = torch.arange(C, device=q.device, dtype=torch.float32)
    head = torch.arange(Hkv, device=q.device)[:, None]
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
    take = (torch.arange(width, device=q.device) < routing.top_k[:, None, None]) & (top.values > float("-inf"))
    opened = torch.zeros(B, Hkv, C, dtype=torch.bool, device=q.device).scatter_(-1, top.indices, take)
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
