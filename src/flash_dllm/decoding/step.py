"""One denoising step (an iteration) for every row of the batch: logits for each row's current block
from a full forward (`reference`, `parallel`) or a cached one (`prefix-cache`, `dual-cache`,
`flash-cache`), then the method's unmasking rule; `elastic`, `flash-verify` and `lossless` run their own
iteration. Rows advance together in tensor ops. Host inputs: the per-row block phase (elastic: query
counts) read at the engine's one sync per step; elastic, flash-verify and lossless read the shape of a
second pass with one more."""
from __future__ import annotations

import torch

from ..cache.kv_cache import KVCache
from ..engine.batch import DecodeBatch
from .elastic import elastic_step
from .fast_dllm_cache import cached_logits
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
        batch.count_query_rows([seq.length * (2 if params.guidance > 0 else 1) for seq in batch.seqs])
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


def denoise_step(model, batch: DecodeBatch, cache: KVCache | None, mask_id: int,
                 stop_ids: torch.Tensor | None = None):
    """stop_ids [S]: the tokens that end an output (elastic's window stops at the first)."""
    params = batch.params
    if params.method == "lossless":
        return lossless_step(model, batch, mask_id)
    if params.method == "elastic":
        return elastic_step(model, batch, cache, mask_id, stop_ids)
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
