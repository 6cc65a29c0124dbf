"""Elastic-Cache's drift test at one layer (Triton), beside its PyTorch reference.

The tracked rows' attention before a step's update of the layer (queries of their cached inputs against the keys
as cached) against after it (fresh queries against the keys with the step's query rows rewritten): the cosine of
the two softmax distributions over the request's keys, per head and tracked row. In PyTorch that is two
[B, H, T, keys] fp32 score tensors, their softmaxes and three reductions, and a copy of the keys per call; the
kernel reads each key tile once for both, in its storage dtype, and keeps three running sums per row:
with p = exp(s - m) / l, cos(p_b, p_a) = sum(e_b e_a) / sqrt(sum(e_b^2) sum(e_a^2)) for e = exp(s - m), as the
normalisers l cancel, so one online pass rescaling the sums by each new running max gives it.
Where the batch's (request, head) programs would leave most of the GPU idle (batch 1: 32 programs on 132 SMs),
the keys are split across programs, and a second kernel merges their running maxima and sums.
From an fp8 cache (kv_fp8.py) the kernel reads the E4M3 keys and scales each key's column of scores by its scale,
as the attention kernel does; the reference dequantises them.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .flash_attention import TARGET_PROGRAMS
from .kv_fp8 import dequantize_kv, scale_arguments

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def drift_cosine_ref(q_before: torch.Tensor, q_after: torch.Tensor, k_cache: torch.Tensor, cache_base: torch.Tensor,
                     lengths: torch.Tensor, before_row: torch.Tensor, old_keys: torch.Tensor,
                     k_scale: torch.Tensor | None = None, old_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q_before, q_after [B, T, H, D]: the tracked rows' queries; k_cache [rows, Hkv, D] after the layer's write;
    request b's position k at cache row cache_base[b] + k, for k < lengths[b]; before_row [B, >= max length]: the row
    of old_keys [N, Hkv, D] that held position k's key before the write (-1: the cache's is unchanged).
    -> [B, H, T] fp32: cosine over the keys of the softmax attention before and after (scaled by D^-0.5).
    k_scale [rows, Hkv], old_scale [N, Hkv] fp32: an fp8 cache's keys, and the old keys as it held them."""
    H, D, width = q_before.shape[2], q_before.shape[3], before_row.shape[1]
    position = torch.arange(width, device=k_cache.device)
    valid = position < lengths[:, None]                                                  # [B, W]
    rows, old_rows = cache_base[:, None] + torch.where(valid, position, 0), before_row.clamp(min=0)
    after, old = k_cache[rows], old_keys[old_rows]                                       # [B, W, Hkv, D]
    if k_scale is not None:
        after, old = (dequantize_kv(after, k_scale[rows], torch.float32),
                      dequantize_kv(old, old_scale[old_rows], torch.float32))
    before = torch.where((before_row >= 0)[..., None, None], old, after)

    def attention(q, keys):
        keys = keys.repeat_interleave(H // keys.shape[2], dim=2).float()
        scores = torch.einsum("bthd,bkhd->bhtk", q.float(), keys) * D ** -0.5
        return scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(dim=-1)

    return F.cosine_similarity(attention(q_before, before), attention(q_after, after), dim=-1)


BLOCK_K = 64  # keys per tile


def key_splits(programs: int, width: int) -> int:
    """How many programs share one (request, head, tracked tile)'s keys: enough for the attention kernel's
    TARGET_PROGRAMS (the H200's SMs about twice over), at least one key tile each."""
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), triton.cdiv(width, BLOCK_K)))


def drift_cosine(q_before: torch.Tensor, q_after: torch.Tensor, k_cache: torch.Tensor, cache_base: torch.Tensor,
                 lengths: torch.Tensor, before_row: torch.Tensor, old_keys: torch.Tensor,
                 splits: int | None = None, out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 old_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of drift_cosine_ref (same arguments, same result up to the order of its sums), its keys
    split across `splits` programs (default: key_splits), written to `out` (contiguous [B, H, T] fp32; default: a
    new tensor). Graph capturable: no host syncs (each program's key loop stops at its request's length, read on
    the device)."""
    if triton is None:
        raise RuntimeError("drift_cosine needs triton; use drift_cosine_ref")
    (B, T, H, D), width, num_kv_heads = q_before.shape, before_row.shape[1], k_cache.shape[1]
    assert q_after.shape == q_before.shape and q_before.stride(-1) == q_after.stride(-1) == 1
    assert k_cache.stride(-1) == old_keys.stride(-1) == 1 and before_row.is_contiguous()
    fp8 = scale_arguments(k_cache, old_keys, k_scale, old_scale)
    if out is None:
        out = torch.empty(B, H, T, dtype=torch.float32, device=q_before.device)
    assert out.shape == (B, H, T) and out.dtype == torch.float32 and out.is_contiguous()
    if B == 0 or T == 0:
        return out
    block_t = min(64, max(16, triton.next_power_of_2(T)))
    tiles = triton.cdiv(T, block_t)
    splits = splits or key_splits(B * H * tiles, width)
    chunk = triton.cdiv(triton.cdiv(width, splits), BLOCK_K) * BLOCK_K             # keys per split
    splits = triton.cdiv(width, chunk)                                              # none past the widest
    # per split and row: the two running maxima and the three sums (the kernel's state at its loop's end)
    partial = out if splits == 1 else torch.empty(5, B, H, splits, T, dtype=torch.float32, device=out.device)
    part_size = partial.numel() // 5
    dot_fp32 = q_before.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _drift_cosine_kernel[(B, H, tiles * splits)](
        q_before, q_after, k_cache, old_keys, *fp8.pointers, cache_base, lengths, before_row, partial,
        q_before.stride(0), q_before.stride(1), q_before.stride(2), q_after.stride(0), q_after.stride(1),
        q_after.stride(2), k_cache.stride(0), k_cache.stride(1), old_keys.stride(0), old_keys.stride(1),
        *fp8.strides, T, width, chunk, splits, part_size, D ** -0.5 * 1.4426950408889634,
        GROUP=H // num_kv_heads, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_T=block_t,
        BLOCK_K=BLOCK_K, KV_FP8=fp8.on, DOT_FP32=dot_fp32, num_warps=4)
    if splits > 1:
        _merge_splits_kernel[(B, H, tiles)](partial, out, T, splits, part_size, BLOCK_T=block_t)
    return out


if triton is not None:
    from .flash_attention import _dot  # exact fp32 products where DOT_FP32 (and under the interpreter)

    # the split count is not a constant of the compiled kernel: a request's width changes it (warm-up included)
    @triton.jit(do_not_specialize=["T", "width", "chunk", "splits", "part_size"])
    def _drift_cosine_kernel(qb_ptr, qa_ptr, k_ptr, old_ptr, ks_ptr, os_ptr, base_ptr, len_ptr, row_ptr, out_ptr,
                             stride_qbb, stride_qbt, stride_qbh, stride_qab, stride_qat, stride_qah,
                             stride_kr, stride_kh, stride_or, stride_oh, stride_ksr, stride_osr, T, width, chunk,
                             splits, part_size, scale_log2, GROUP: tl.constexpr, D: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                             KV_FP8: tl.constexpr, DOT_FP32: tl.constexpr):
        # Program (request, head, tile of tracked rows x split of the keys): one sweep over the split's keys for
        # both queries. One split: the cosine; more: the running maxima and sums, for _merge_splits_kernel.
        seq, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        tile, split = tl.program_id(2) // splits, tl.program_id(2) % splits
        kv_head = head // GROUP
        o_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        o_d = tl.arange(0, BLOCK_D)
        m_t, m_d = o_t < T, o_d < D
        m_q = m_t[:, None] & m_d[None, :]
        b_qb = tl.load(qb_ptr + seq * stride_qbb + o_t[:, None] * stride_qbt + head * stride_qbh + o_d[None, :],
                       mask=m_q, other=0.0)
        b_qa = tl.load(qa_ptr + seq * stride_qab + o_t[:, None] * stride_qat + head * stride_qah + o_d[None, :],
                       mask=m_q, other=0.0)
        base, length = tl.load(base_ptr + seq), tl.load(len_ptr + seq)
        end = tl.minimum(length, (split + 1) * chunk)
        max_b = tl.full([BLOCK_T], float("-inf"), tl.float32)
        max_a = tl.full([BLOCK_T], float("-inf"), tl.float32)
        sum_ab = tl.zeros([BLOCK_T], tl.float32)
        sum_bb = tl.zeros([BLOCK_T], tl.float32)
        sum_aa = tl.zeros([BLOCK_T], tl.float32)
        for start in range(split * chunk, end, BLOCK_K):
            o_k = start + tl.arange(0, BLOCK_K)
            m_k = o_k < end
            b_after = tl.load(k_ptr + (base + o_k)[:, None] * stride_kr + kv_head * stride_kh + o_d[None, :],
                              mask=m_k[:, None] & m_d[None, :], other=0.0)
            b_row = tl.load(row_ptr + seq * width + o_k, mask=m_k, other=-1)
            b_old = tl.load(old_ptr + b_row[:, None].to(tl.int64) * stride_or + kv_head * stride_oh + o_d[None, :],
                            mask=(b_row >= 0)[:, None] & m_d[None, :], other=0.0)
            b_before = tl.where((b_row >= 0)[:, None], b_old, b_after)
            if KV_FP8:  # E4M3 keys, exact in the queries' dtype; each key's scale on its column of scores
                b_ks = tl.load(ks_ptr + (base + o_k) * stride_ksr + kv_head, mask=m_k, other=0.0)
                b_os = tl.load(os_ptr + b_row.to(tl.int64) * stride_osr + kv_head, mask=b_row >= 0, other=0.0)
                b_bs = tl.where(b_row >= 0, b_os, b_ks)
                s_b = _dot(b_qb, tl.trans(b_before.to(b_qb.dtype)), DOT_FP32) * b_bs[None, :]
                s_a = _dot(b_qa, tl.trans(b_after.to(b_qa.dtype)), DOT_FP32) * b_ks[None, :]
            else:
                s_b = _dot(b_qb, tl.trans(b_before), DOT_FP32)
                s_a = _dot(b_qa, tl.trans(b_after), DOT_FP32)
            s_b = tl.where(m_k[None, :], s_b * scale_log2, float("-inf"))
            s_a = tl.where(m_k[None, :], s_a * scale_log2, float("-inf"))
            new_b = tl.maximum(max_b, tl.max(s_b, 1))
            new_a = tl.maximum(max_a, tl.max(s_a, 1))
            e_b = tl.exp2(s_b - new_b[:, None])
            e_a = tl.exp2(s_a - new_a[:, None])
            r_b, r_a = tl.exp2(max_b - new_b), tl.exp2(max_a - new_a)
            sum_bb = sum_bb * r_b * r_b + tl.sum(e_b * e_b, 1)
            sum_aa = sum_aa * r_a * r_a + tl.sum(e_a * e_a, 1)
            sum_ab = sum_ab * r_b * r_a + tl.sum(e_b * e_a, 1)
            max_b, max_a = new_b, new_a
        if splits == 1:
            tl.store(out_ptr + (seq * tl.num_programs(1) + head) * T + o_t, sum_ab / tl.sqrt(sum_bb * sum_aa),
                     mask=m_t)
        else:  # partial [5, B, H, splits, T]
            at = out_ptr + ((seq * tl.num_programs(1) + head) * splits + split) * T + o_t
            tl.store(at, max_b, mask=m_t)
            tl.store(at + part_size, max_a, mask=m_t)
            tl.store(at + 2 * part_size, sum_ab, mask=m_t)
            tl.store(at + 3 * part_size, sum_bb, mask=m_t)
            tl.store(at + 4 * part_size, sum_aa, mask=m_t)

    @triton.jit(do_not_specialize=["T", "splits", "part_size"])
    def _merge_splits_kernel(part_ptr, out_ptr, T, splits, part_size, BLOCK_T: tl.constexpr):
        # Program (request, head, tile of tracked rows): the splits' sums rescaled to the overall maxima, in order.
        seq, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        o_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < T
        first = part_ptr + (seq * tl.num_programs(1) + head) * splits * T + o_t
        max_b = tl.full([BLOCK_T], float("-inf"), tl.float32)
        max_a = tl.full([BLOCK_T], float("-inf"), tl.float32)
        for split in range(splits):
            max_b = tl.maximum(max_b, tl.load(first + split * T, mask=m_t, other=0.0))
            max_a = tl.maximum(max_a, tl.load(first + split * T + part_size, mask=m_t, other=0.0))
        sum_ab = tl.zeros([BLOCK_T], tl.float32)
        sum_bb = tl.zeros([BLOCK_T], tl.float32)
        sum_aa = tl.zeros([BLOCK_T], tl.float32)
        for split in range(splits):
            at = first + split * T
            # a split past its request's keys kept -inf maxima and zero sums: it adds nothing
            r_b = tl.exp2(tl.load(at, mask=m_t, other=0.0) - max_b)
            r_a = tl.exp2(tl.load(at + part_size, mask=m_t, other=0.0) - max_a)
            sum_ab += tl.load(at + 2 * part_size, mask=m_t, other=0.0) * r_b * r_a
            sum_bb += tl.load(at + 3 * part_size, mask=m_t, other=0.0) * r_b * r_b
            sum_aa += tl.load(at + 4 * part_size, mask=m_t, other=0.0) * r_a * r_a
        tl.store(out_ptr + (seq * tl.num_programs(1) + head) * T + o_t, sum_ab / tl.sqrt(sum_bb * sum_aa), mask=m_t)
