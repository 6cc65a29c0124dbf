"""The softmax attention of a few query rows over a request's whole cache range (Triton), beside its PyTorch
reference: Elastic-Cache's drift test compares the tracked rows' attention before and after a step's update.

In PyTorch that is a gather of every key from the cache, its conversion to fp32, the GQA repeat, a matmul and
a softmax: at batch 32 the conversions alone moved about a GB per layer. The kernel reads each key once from
the cache in its own dtype and computes in fp32 (an exact fp32 dot product, no TF32), two passes over the key
tiles: the row maxima and sums, then the probabilities.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def drift_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, key_slot: torch.Tensor,
                        key_valid: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D] (rotated queries), k_cache [rows, Hkv, D], key_slot [B, K] (the cache row of each key),
    key_valid [B, K] -> softmax attention [B, H, T, K] in fp32 (0 at invalid keys)."""
    keys = k_cache[key_slot]
    keys = keys.repeat_interleave(q.shape[2] // keys.shape[2], dim=2)  # GQA: kv head j serves heads j*g..
    scores = torch.einsum("bthd,bkhd->bhtk", q.float(), keys.float()) * q.shape[-1] ** -0.5
    return scores.masked_fill(~key_valid[:, None, None, :], float("-inf")).softmax(dim=-1)


def drift_attention(q: torch.Tensor, k_cache: torch.Tensor, key_slot: torch.Tensor,
                    key_valid: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of drift_attention_ref (same arguments, same result; a row with no valid key gets
    zeros, where the reference gives NaN). Graph capturable: no host syncs."""
    if triton is None:
        raise RuntimeError("drift_attention needs triton; use drift_attention_ref")
    B, T, H, D = q.shape
    K, kv_heads = key_slot.shape[1], k_cache.shape[1]
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and H % kv_heads == 0
    out = torch.empty(B, H, T, K, dtype=torch.float32, device=q.device)
    if B * T * K == 0:
        return out
    slots, valid = key_slot.contiguous(), key_valid.contiguous()
    _drift_attention_kernel[(B, H)](
        q, k_cache, slots, valid, out, T, K, H // kv_heads, D ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), slots.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=D, BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_K=64, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _drift_scores(q, k_cache_ptr, slots_ptr, valid_ptr, b, kv_head, k0, K, scale, stride_kr, stride_kh,
                      stride_sb, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
        """Scores [BLOCK_T, BLOCK_K] of the query tile against keys k0.. (-inf where invalid or past K)."""
        o_k = k0 + tl.arange(0, BLOCK_K)
        o_d = tl.arange(0, BLOCK_D)
        in_range = o_k < K
        slot = tl.load(slots_ptr + b * stride_sb + o_k, mask=in_range, other=0).to(tl.int64)
        valid = tl.load(valid_ptr + b * stride_sb + o_k, mask=in_range, other=0) != 0
        p_k = k_cache_ptr + slot[:, None] * stride_kr + kv_head * stride_kh + o_d[None, :]
        b_k = tl.load(p_k, mask=in_range[:, None] & (o_d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(b_k), input_precision="ieee") * scale
        return tl.where((valid & in_range)[None, :], scores, float("-inf"))

    @triton.jit
    def _drift_attention_kernel(q_ptr, k_cache_ptr, slots_ptr, valid_ptr, out_ptr, T, K, group, scale,
                                stride_qb, stride_qt, stride_qh, stride_kr, stride_kh, stride_sb,
                                stride_ob, stride_oh, stride_ot,
                                HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_K: tl.constexpr):
        # Program (request b, query head h): its T rows against every key, in tiles of BLOCK_K.
        b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        kv_head = h // group
        o_t, o_d = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D)
        p_q = q_ptr + b * stride_qb + o_t[:, None] * stride_qt + h * stride_qh + o_d[None, :]
        q = tl.load(p_q, mask=(o_t < T)[:, None] & (o_d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
        m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_T,), tl.float32)
        for k0 in range(0, K, BLOCK_K):  # pass 1: row maxima and sums of exp, rescaled as the maxima grow
            scores = _drift_scores(q, k_cache_ptr, slots_ptr, valid_ptr, b, kv_head, k0, K, scale, stride_kr,
                                   stride_kh, stride_sb, HEAD_DIM, BLOCK_D, BLOCK_K)
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: nothing to rescale
            total = total * tl.exp(m - safe) + tl.sum(tl.exp(scores - safe[:, None]), axis=1)
            m = m_new
        safe = tl.where(m == float("-inf"), 0.0, m)
        inverse = 1.0 / tl.where(total > 0, total, float("inf"))  # no valid key: zeros
        for k0 in range(0, K, BLOCK_K):  # pass 2: the probabilities
            scores = _drift_scores(q, k_cache_ptr, slots_ptr, valid_ptr, b, kv_head, k0, K, scale, stride_kr,
                                   stride_kh, stride_sb, HEAD_DIM, BLOCK_D, BLOCK_K)
            probs = tl.exp(scores - safe[:, None]) * inverse[:, None]
            o_k = k0 + tl.arange(0, BLOCK_K)
            p_out = out_ptr + b * stride_ob + h * stride_oh + o_t[:, None] * stride_ot + o_k[None, :]
            tl.store(p_out, probs, mask=(o_t < T)[:, None] & (o_k < K)[None, :])
