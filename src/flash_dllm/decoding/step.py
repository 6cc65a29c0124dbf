"""One denoising step: logits for each row's current block, from a full forward (`reference`,
`parallel`) or a cached forward (`prefix-cache`, `dual-cache`, `flash-cache`), then the method's
unmasking rule.
Rows advance together in tensor ops; the only host input is the per-row block phase that the engine
reads at its one sync per step."""
from __future__ import annotations

import torch

from ..cache.block_table import BlockTable
from ..cache.kv_cache import KVCache
from ..engine.batch import DecodeBatch
from .flash_cache import flash_cache_logits, note_decoded
from .flash_verify import flash_verify_transfer
from .lossless import lossless_step
from .sampling import REMASK_STREAM, counter_uniform, sample_tokens
from .transfer import linear_schedule, transfer_factor, transfer_threshold, transfer_top_k


def full_forward_logits(model, batch: DecodeBatch, columns: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Logits [B, n, V] (fp32) of the given columns [B, n], with classifier-free guidance if set."""
    tokens, attention_mask, positions = batch.tokens, batch.attention_mask, batch.positions
    guidance = batch.params.guidance
    if guidance > 0:  # the unconditional copy has its prompt replaced by masks
        is_prompt = attention_mask & (torch.arange(tokens.shape[1], device=tokens.device) < batch.gen_start)
        tokens = torch.cat([tokens, tokens.masked_fill(is_prompt, mask_id)])
        attention_mask, positions, columns = (torch.cat([t, t]) for t in (attention_mask, positions, columns))
    hidden = model.hidden_states(tokens, positions, attention_mask)
    rows = hidden.gather(1, columns[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.compute_logits(rows).float()
    if guidance > 0:
        cond, uncond = logits.chunk(2)
        logits = uncond + (guidance + 1) * (cond - uncond)
    return logits


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
    for seq, count in zip(batch.seqs, counts):
        seq.query_rows += count
    lengths = [seq.length for seq in batch.seqs]
    as_tensor = lambda values: torch.tensor(values, device=device)
    num_rows = sum(counts)
    counts_t = as_tensor(counts)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long, device=device), counts_t.cumsum(0)])
    row = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t, output_size=num_rows)
    positions = as_tensor(starts)[row] + torch.arange(num_rows, device=device) - cu_seqlens[row]
    width = batch.tokens.shape[1]
    input_ids = batch.tokens[row, (width - as_tensor(lengths))[row] + positions]
    table = BlockTable(cu_seqlens_q=cu_seqlens, kv_start=batch.cache_base, kv_len=as_tensor(lengths),
                       slot_mapping=batch.cache_base[row] + positions, max_q=max(counts), max_kv=max(lengths))
    hidden = model.forward_cached(input_ids, positions, table, cache)
    block_rows = (cu_seqlens[:-1] + as_tensor(offsets))[:, None] + torch.arange(batch.params.block_length, device=device)
    return model.compute_logits(hidden[block_rows]).float()


def block_transfer(model, batch: DecodeBatch, cache: KVCache | None, columns: torch.Tensor,
                   block_offsets: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens [B, n] for the block and which positions to unmask [B, n], by the method's rule."""
    params = batch.params
    if params.method == "flash-cache":
        logits, _ = flash_cache_logits(model, batch, cache, columns, mask_id)
    elif params.uses_cache:
        logits = cached_logits(model, batch, cache)
    else:
        logits = full_forward_logits(model, batch, columns, mask_id)
        for seq in batch.seqs:
            seq.query_rows += seq.length * (2 if params.guidance > 0 else 1)
    masked = batch.tokens.gather(1, columns) == mask_id
    candidates, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.steps, block_offsets,
                                           sample=batch.is_sampling, mask_id=mask_id)
    if params.uses_random_remasking:
        confidence = counter_uniform(batch.seed, batch.steps, block_offsets, REMASK_STREAM)
    confidence = confidence.masked_fill(~masked, float("-inf"))
    if params.method == "reference":
        k = linear_schedule(params.block_length, params.steps_per_block, batch.step_in_block)
        return candidates, transfer_top_k(confidence, masked, k)
    if params.factor is not None:
        return candidates, transfer_factor(confidence, masked, batch.rule_value)
    return candidates, transfer_threshold(confidence, masked, batch.rule_value)


def denoise_step(model, batch: DecodeBatch, cache: KVCache | None, mask_id: int):
    params = batch.params
    if params.method == "lossless":
        return lossless_step(model, batch, mask_id)
    block_offsets = batch.block_index[:, None] * params.block_length + torch.arange(
        params.block_length, device=batch.tokens.device)          # [B, n] within the generated region
    columns = batch.gen_start + block_offsets                      # [B, n] within the row
    if params.method == "flash-verify":
        candidates, transfer = flash_verify_transfer(model, batch, cache, columns, block_offsets, mask_id)
    else:
        candidates, transfer = block_transfer(model, batch, cache, columns, block_offsets, mask_id)
    block = batch.tokens.gather(1, columns)
    if params.method in ("flash-cache", "flash-verify"):
        note_decoded(batch, columns, transfer)
    block = torch.where(transfer, candidates, block)
    batch.tokens.scatter_(1, columns, block)
    batch.nfe += 2 if params.guidance > 0 else 1
    batch.steps += 1
    block_done = ~(block == mask_id).any(dim=1)
    batch.block_index += block_done.long()
    batch.step_in_block = torch.where(block_done, 0, batch.step_in_block + 1)
