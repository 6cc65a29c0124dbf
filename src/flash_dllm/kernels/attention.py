"""Scheduled attention over the attention metadata, PyTorch reference.

Each request's query rows attend to its range of the flat KV cache. The reference pads queries and keys
per request with index tensors (no Python loop over the batch); the Triton kernel (flash_attention.py)
replaces it and is tested against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata


def _padded_index(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] starts and lengths -> row index [B, width] (clamped in range) and validity [B, width]."""
    offsets = torch.arange(width, device=starts.device)
    valid = offsets < lengths[:, None]
    return torch.where(valid, starts[:, None] + offsets, starts[:, None]), valid


def ragged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                         key_mass: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                         v_new: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D]; k_cache, v_cache [rows, Hkv, D] -> out [N, H, D] in q's dtype.

    With key_mass [B, max_kv] (fp32), adds for every key the softmax probability it receives, summed over
    heads and over the query rows marked in metadata.track_rows. With k_new, v_new [N, Hkv, D] (a pass that
    does not write the cache), the rows also attend to these keys under metadata.self_visibility.
    """
    group = q.shape[1] // k_cache.shape[1]
    q_lens = metadata.cu_seqlens_q[1:] - metadata.cu_seqlens_q[:-1]
    q_index, q_valid = _padded_index(metadata.cu_seqlens_q[:-1], q_lens, metadata.max_q)
    q_index = q_index.clamp(max=q.shape[0] - 1)  # a request with no rows this pass
    kv_index, kv_valid = _padded_index(metadata.kv_start, metadata.kv_len, metadata.max_kv)
    expand = lambda t: t.repeat_interleave(group, dim=2).transpose(1, 2)
    qp = q[q_index].transpose(1, 2)                                                  # [B, H, Q, D]
    kp, vp = expand(k_cache[kv_index]), expand(v_cache[kv_index])                   # [B, H, K, D]
    if metadata.hidden_keys is not None:
        kv_valid = kv_valid & ~metadata.hidden_keys
    mask = kv_valid[:, None, None, :]
    if k_new is not None:
        kp, vp = torch.cat([kp, expand(k_new[q_index])], dim=2), torch.cat([vp, expand(v_new[q_index])], dim=2)
        own = metadata.self_visibility & q_valid[:, None, :]
        mask = torch.cat([kv_valid[:, None, :].expand(-1, metadata.max_q, -1), own], dim=2)[:, None]
    if key_mass is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
    else:
        scores = torch.einsum("bhqd,bhkd->bhqk", qp.float(), kp.float()) * q.shape[-1] ** -0.5
        # A row that sees no key (an empty KV range) has probability 0 everywhere, not NaN, as in the kernel.
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, vp.float()).to(q.dtype)
        tracked = q_valid & metadata.track_rows[q_index]                                # [B, Q]
        key_mass += (probs * tracked[:, None, :, None]).sum(dim=(1, 2))
    return out.transpose(1, 2)[q_valid]                                              # [N, H, D]
