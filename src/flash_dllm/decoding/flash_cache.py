"""Flash-Cache: selective cache update.

After a full first pass, a step recomputes a fixed-size set of query positions per sequence,
Q = min(beta_m + beta_t, L): the window of the beta_m leftmost masked positions, then decoded positions
in this order: those decoded in the previous step, then by the softmax attention mass the masked queries
gave them in the previous step (over layers and heads). When fewer than beta_m masks remain, or fewer
than beta_t positions are decoded, the spare rows go to the remaining candidates (decoded positions, or
the nearest masks beyond the window), so the query count stays fixed. Every other position is read from
the KV cache. Per-position state: `key_mass` (last step's attention mass) and `decoded_at` (the step
that decoded the position; -1 for the prompt and for masks).
"""
from __future__ import annotations

import torch

from ..cache.block_table import BlockTable, cu_seqlens, flat_rows
from ..cache.kv_cache import KVCache
from ..engine.batch import DecodeBatch


def initial_position_state(length: int, device) -> dict[str, torch.Tensor]:
    return {"key_mass": torch.zeros(length, device=device),
            "decoded_at": torch.full((length,), -1, dtype=torch.long, device=device)}


def query_counts(batch: DecodeBatch) -> list[int]:
    """Rows per sequence this step: everything on its first pass, else the fixed budget."""
    budget = batch.params.window + batch.params.tracked
    return [seq.length if seq.query_rows == 0 else min(budget, seq.length) for seq in batch.seqs]


def query_priority(batch: DecodeBatch, mask_id: int) -> torch.Tensor:
    """[B, W] score whose top-Q columns per row are the step's queries (-inf: never a query)."""
    tokens, real = batch.tokens, batch.attention_mask
    width = tokens.shape[1]
    columns = torch.arange(width, device=tokens.device)
    masked = (tokens == mask_id) & (columns >= batch.gen_start)
    window = masked & (masked.cumsum(dim=1) <= batch.params.window)
    decoded = real & ~masked
    newly = decoded & (batch.position_state["decoded_at"] == (batch.steps - 1)[:, None])
    mass = batch.position_state["key_mass"]
    relative_mass = mass / (mass.amax(dim=1, keepdim=True) + 1e-30)               # in [0, 1]
    priority = torch.where(masked, 1.0 - columns / width, 2.0 + relative_mass)      # decoded above far masks
    priority = torch.where(newly, 3.5, priority)
    priority = torch.where(window, 5.0, priority)
    return priority.masked_fill(~real, float("-inf"))


def flash_cache_logits(model, batch: DecodeBatch, cache: KVCache, block_columns: torch.Tensor,
                       mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the step's query rows through the cached forward. Returns logits [B, n, V] of the block
    columns (rows of the block that are not queries are decoded positions, whose logits are never used)
    and the query columns [B, Qmax] (ascending; the batch width where a row has fewer)."""
    device = batch.tokens.device
    counts = query_counts(batch)
    batch.count_query_rows(counts)
    width, lengths = batch.tokens.shape[1], batch.lengths
    max_q, num_rows, cu = max(counts), sum(counts), cu_seqlens(counts, device)
    chosen = torch.topk(query_priority(batch, mask_id), max_q, dim=1).indices          # [B, Qmax]
    valid = torch.arange(max_q, device=device) < (cu[1:] - cu[:-1])[:, None]
    chosen = torch.where(valid, chosen, width).sort(dim=1).values                      # ascending, invalid last
    rows, rank = flat_rows(counts, cu)
    columns = chosen[rows, rank]                                                       # [N] flat, by sequence
    positions = columns - (width - lengths)[rows]
    input_ids = batch.tokens[rows, columns]
    table = BlockTable(cu_seqlens_q=cu, kv_start=batch.cache_base, kv_len=lengths,
                       slot_mapping=batch.cache_base[rows] + positions, max_q=max_q,
                       max_kv=int(max(seq.length for seq in batch.seqs)), track_rows=input_ids == mask_id)
    key_mass = torch.zeros(len(counts), table.max_kv, device=device)
    hidden = model.forward_cached(input_ids, positions, table, cache, key_mass=key_mass)

    # key_mass is indexed by position; store it by column for the next step's choice. Offsets past a row's
    # length add their 0 to its last column (a scatter without boolean indexing).
    kv_columns = (width - lengths)[:, None] + torch.arange(table.max_kv, device=device)
    in_range = torch.arange(table.max_kv, device=device) < lengths[:, None]
    mass = torch.zeros_like(batch.position_state["key_mass"])
    mass.scatter_add_(1, kv_columns.clamp(max=width - 1), torch.where(in_range, key_mass, 0.0))
    batch.position_state["key_mass"] = mass

    flat_of_column = torch.full_like(batch.tokens, -1)
    flat_of_column[rows, columns] = torch.arange(num_rows, device=device)
    block_rows = flat_of_column.gather(1, block_columns).clamp(min=0)
    return model.compute_logits(hidden[block_rows]).float(), chosen


def note_decoded(batch: DecodeBatch, block_columns: torch.Tensor, transfer: torch.Tensor):
    decoded_at = batch.position_state["decoded_at"]
    current = decoded_at.gather(1, block_columns)
    decoded_at.scatter_(1, block_columns, torch.where(transfer, batch.steps[:, None], current))
