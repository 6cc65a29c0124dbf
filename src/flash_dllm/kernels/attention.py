"""Scheduled attention over the block table, PyTorch reference.

Each request's query rows attend to its range of the flat KV cache. The reference pads queries and keys
per request with index tensors (no Python loop over the batch); the Triton kernel of the kernels issue
replaces it and is tested against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.block_table import BlockTable


def _padded_index(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] starts and lengths -> row index [B, width] (clamped in range) and validity [B, width]."""
    offsets = torch.arange(width, device=starts.device)
    valid = offsets < lengths[:, None]
    return torch.where(valid, starts[:, None] + offsets, starts[:, None]), valid


def ragged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: BlockTable,
                         key_mass: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D]; k_cache, v_cache [rows, Hkv, D] -> out [N, H, D] in q's dtype.

    With key_mass [B, max_kv] (fp32), adds for every key the softmax probability it receives, summed over
    heads and over the query rows marked in table.track_rows.
    """
    num_heads, group = q.shape[1], q.shape[1] // k_cache.shape[1]
    q_lens = table.cu_seqlens_q[1:] - table.cu_seqlens_q[:-1]
    q_index, q_valid = _padded_index(table.cu_seqlens_q[:-1], q_lens, table.max_q)
    kv_index, kv_valid = _padded_index(table.kv_start, table.kv_len, table.max_kv)
    qp = q[q_index].transpose(1, 2)                                                  # [B, H, Q, D]
    kp = k_cache[kv_index].repeat_interleave(group, dim=2).transpose(1, 2)          # [B, H, K, D]
    vp = v_cache[kv_index].repeat_interleave(group, dim=2).transpose(1, 2)
    if key_mass is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=kv_valid[:, None, None, :])
    else:
        scores = torch.einsum("bhqd,bhkd->bhqk", qp.float(), kp.float()) * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~kv_valid[:, None, None, :], float("-inf")).softmax(dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, vp.float()).to(q.dtype)
        tracked = q_valid & table.track_rows[q_index]                                # [B, Q]
        key_mass += (probs * tracked[:, None, :, None]).sum(dim=(1, 2))
    return out.transpose(1, 2)[q_valid]                                              # [N, H, D]
