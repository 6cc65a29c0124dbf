"""Fast-dLLM's prefix and dual caches: which rows a step recomputes, and the cached forward over them."""
from __future__ import annotations

import torch

from ..cache.block_table import BlockTable, cu_seqlens, device_tensor, flat_rows
from ..cache.kv_cache import KVCache
from ..engine.batch import DecodeBatch


def query_ranges(batch: DecodeBatch) -> tuple[list[int], list[int], list[int]]:
    """Per row: first query position, number of query rows, and offset of the block inside them.

    A refresh step (block start, or every `refresh_interval` steps) recomputes the whole sequence and
    rewrites its K/V; otherwise prefix-cache recomputes the block and everything after it, dual-cache
    the block alone, and the rest comes from the cache."""
    params = batch.params
    starts, counts, offsets = [], [], []
    for seq, block_index, step in zip(batch.seqs, batch.host_block_index, batch.host_step_in_block):
        block_start = len(seq.prompt_ids) + block_index * params.block_length
        interval = params.refresh_interval
        if step == 0 or (interval is not None and step % interval == 0):
            starts.append(0), counts.append(seq.length), offsets.append(block_start)
        elif params.method == "prefix-cache":
            starts.append(block_start), counts.append(seq.length - block_start), offsets.append(0)
        else:
            starts.append(block_start), counts.append(params.block_length), offsets.append(0)
    return starts, counts, offsets


def cached_logits(model, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
    device = batch.tokens.device
    starts, counts, offsets = query_ranges(batch)
    batch.count_query_rows(counts)
    as_tensor = lambda values: device_tensor(values, device)  # torch.tensor(values, device=) would sync
    offsets_q = cu_seqlens(counts, device)
    row, rank = flat_rows(counts, offsets_q)
    positions = as_tensor(starts)[row] + rank
    width = batch.tokens.shape[1]
    input_ids = batch.tokens[row, (width - batch.lengths)[row] + positions]
    table = BlockTable(cu_seqlens_q=offsets_q, kv_start=batch.cache_base, kv_len=batch.lengths,
                       slot_mapping=batch.cache_base[row] + positions, max_q=max(counts),
                       max_kv=max(seq.length for seq in batch.seqs))
    hidden = model.forward_cached(input_ids, positions, table, cache)
    block_rows = (offsets_q[:-1] + as_tensor(offsets))[:, None] + torch.arange(batch.params.block_length, device=device)
    return model.compute_logits(hidden[block_rows]).float()
