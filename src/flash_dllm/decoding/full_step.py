"""One denoising step of the no-cache methods (`reference`, `parallel`): a full forward over every
row, logits only for the current block, then the method's unmasking rule. All rows advance in one set
of tensor ops; nothing here waits for the device."""
from __future__ import annotations

import torch

from ..engine.batch import DecodeBatch
from .sampling import REMASK_STREAM, counter_uniform, sample_tokens
from .transfer import linear_schedule, transfer_factor, transfer_threshold, transfer_top_k


def block_logits(model, batch: DecodeBatch, columns: torch.Tensor, mask_id: int) -> torch.Tensor:
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


def full_forward_step(model, batch: DecodeBatch, mask_id: int):
    params = batch.params
    block_offsets = batch.block_index[:, None] * params.block_length + torch.arange(
        params.block_length, device=batch.tokens.device)          # [B, n] within the generated region
    columns = batch.gen_start + block_offsets                      # [B, n] within the row
    logits = block_logits(model, batch, columns, mask_id)
    block = batch.tokens.gather(1, columns)
    masked = block == mask_id
    candidates, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.steps, block_offsets,
                                           sample=batch.is_sampling, mask_id=mask_id)
    if params.uses_random_remasking:
        confidence = counter_uniform(batch.seed, batch.steps, block_offsets, REMASK_STREAM)
    confidence = confidence.masked_fill(~masked, float("-inf"))

    if params.method == "reference":
        k = linear_schedule(params.block_length, params.steps_per_block, batch.step_in_block)
        transfer = transfer_top_k(confidence, masked, k)
    elif params.factor is not None:
        transfer = transfer_factor(confidence, masked, batch.rule_value)
    else:
        transfer = transfer_threshold(confidence, masked, batch.rule_value)

    block = torch.where(transfer, candidates, block)
    batch.tokens.scatter_(1, columns, block)
    batch.nfe += 2 if params.guidance > 0 else 1
    batch.steps += 1
    block_done = ~(block == mask_id).any(dim=1)
    batch.block_index += block_done.long()
    batch.step_in_block = torch.where(block_done, 0, batch.step_in_block + 1)
