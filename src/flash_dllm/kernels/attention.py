"""Scheduled attention over the attention metadata, PyTorch reference; and attention whose sums over keys run in
one fixed order (batch-invariant decoding).

Each request's query rows attend to its range of the flat KV cache. The reference pads queries and keys
per request with index tensors (no Python loop over the batch); the Triton kernel (flash_attention.py)
replaces it and is tested against it.

PyTorch's attention, softmax and matmuls group a sum over keys by its length: padding keys (exact zeros after
the softmax) still change how the real ones are grouped, so a request's result depends on the longest request
of its batch. `ordered_attention` sums keys in chunks of ORDER_CHUNK by matmul (a fixed length), then the
chunks' partial sums left to right: a row's result depends only on its visible keys and their positions from
index 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata, padded_index


ORDER_CHUNK = 64


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` added left to right, one element at a time (a scan): zeros that follow the values,
    however many, leave it unchanged."""
    return x.cumsum(dim).select(dim, -1)


def ordered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, Q or K, D]; v [B, H, K, Dv]; visible [B, 1 or H, 1 or Q, K] -> (out [B, H, Q, Dv] in q's dtype,
    probabilities [B, H, Q, K] fp32), every sum over keys in one order (module docstring). A row that sees no
    key gets zeros."""
    B, H, Q, D = q.shape
    K = k.shape[2]
    padded = -(-K // ORDER_CHUNK) * ORDER_CHUNK
    pad_keys = lambda t: F.pad(t.float(), (0, 0, 0, padded - K))
    scores = (q.float() @ pad_keys(k).transpose(-1, -2)) * D ** -0.5                  # sums over D only
    visible = F.pad(visible, (0, padded - K)).expand(B, H, Q, padded)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))        # 0 where not visible
    values = torch.cat([pad_keys(v), torch.ones(B, H, padded, 1, device=v.device)], dim=-1)  # and the sum
    chunks, Dv = padded // ORDER_CHUNK, v.shape[-1]
    partial = weights.view(B, H, Q, chunks, ORDER_CHUNK).transpose(2, 3) @ values.view(B, H, chunks, ORDER_CHUNK,
                                                                                        Dv + 1)
    total = ordered_sum(partial, dim=2)                                                 # [B, H, Q, Dv + 1]
    normaliser = total[..., Dv:].masked_fill(total[..., Dv:] == 0, 1.0)
    out = (total[..., :Dv] / normaliser).to(q.dtype)
    return out, (weights / normaliser)[..., :K]


def ragged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                         key_mass: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                         v_new: torch.Tensor | None = None, key_visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D]; k_cache, v_cache [rows, Hkv, D] -> out [N, H, D] in q's dtype.

    With key_mass [B, max_kv] (fp32), adds for every key the softmax probability it receives, summed over
    heads and over the query rows marked in metadata.track_rows. With k_new, v_new [N, Hkv, D] (a pass that
    does not write the cache), the rows also attend to these keys under metadata.self_visibility. With
    key_visible [B, Hkv, max_kv] bool (routed prompt keys), each KV head's rows read only the keys it marks.
    """
    group = q.shape[1] // k_cache.shape[1]
    q_lens = metadata.cu_seqlens_q[1:] - metadata.cu_seqlens_q[:-1]
    q_index, q_valid = padded_index(metadata.cu_seqlens_q[:-1], q_lens, metadata.max_q)
    q_index = q_index.clamp(max=q.shape[0] - 1)  # a request with no rows this pass
    kv_index, kv_valid = padded_index(metadata.kv_start, metadata.kv_len, metadata.max_kv)
    expand = lambda t: t.repeat_interleave(group, dim=2).transpose(1, 2)
    qp = q[q_index].transpose(1, 2)                                                  # [B, H, Q, D]
    kp, vp = expand(k_cache[kv_index]), expand(v_cache[kv_index])                   # [B, H, K, D]
    if metadata.hidden_keys is not None:
        kv_valid = kv_valid & ~metadata.hidden_keys
    mask = kv_valid[:, None, None, :]                                                # [B, 1 or H, 1, K]
    if key_visible is not None:
        assert not metadata.ordered, "routed keys are not summed in the batch-invariant order"
        routed = key_visible.repeat_interleave(group, dim=1)[:, :, None, :]                 # [B, H, 1, K]
        mask = mask & routed
    if k_new is not None:
        kp, vp = torch.cat([kp, expand(k_new[q_index])], dim=2), torch.cat([vp, expand(v_new[q_index])], dim=2)
        own = metadata.self_visibility & q_valid[:, None, :]
        cache_part = mask.expand(-1, -1, metadata.max_q, -1)
        mask = torch.cat([cache_part, own[:, None].expand(-1, cache_part.shape[1], -1, -1)], dim=3)
    if metadata.ordered:
        if k_new is not None:  # its own keys right after its cache range, wherever the batch's longest ends
            kp, vp, mask = _own_keys_after_cache(kp, vp, mask, metadata, q_index)
        out, probs = ordered_attention(qp, kp, vp, mask)
        if key_mass is not None:
            tracked = q_valid & metadata.track_rows[q_index]
            mass = (probs[..., :metadata.max_kv] * tracked[:, None, :, None]).flatten(1, 2)  # [B, H * Q, K]
            key_mass += ordered_sum(mass, dim=1)
    elif key_mass is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
    else:
        scores = torch.einsum("bhqd,bhkd->bhqk", qp.float(), kp.float()) * q.shape[-1] ** -0.5
        # A row that sees no key (an empty KV range) has probability 0 everywhere, not NaN, as in the kernel.
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, vp.float()).to(q.dtype)
        tracked = q_valid & metadata.track_rows[q_index]                                # [B, Q]
        key_mass += (probs * tracked[:, None, :, None]).sum(dim=(1, 2))
    return out.transpose(1, 2)[q_valid]                                              # [N, H, D]


def _own_keys_after_cache(kp, vp, mask, metadata: AttentionMetadata, q_index):
    """A verify pass's key axis [cache range padded to max_kv | own rows padded to max_q] rearranged so that each
    request's own rows follow its own cache range: key j of request b comes from column j of the old axis while
    j < kv_len[b], from max_kv + (j - kv_len[b]) after that."""
    width = kp.shape[2]
    j = torch.arange(width, device=kp.device)
    kv_len = metadata.kv_len[:, None]
    source = torch.where(j < kv_len, j, (metadata.max_kv + j - kv_len).clamp(max=width - 1))    # [B, width]
    gather = lambda t: t.gather(2, source[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
    moved = mask.expand(-1, -1, mask.shape[2], -1).gather(3, source[:, None, None, :].expand(-1, 1, mask.shape[2], -1))
    moved &= (j < kv_len + metadata.max_q)[:, None, None, :]
    return gather(kp), gather(vp), moved
