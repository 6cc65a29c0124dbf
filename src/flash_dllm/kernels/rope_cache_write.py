"""RoPE + KV cache write of a projected q|k|v (Triton), beside its PyTorch reference.

The epilogue of a cuBLAS QKV projection: one launch rotates Q (returned) and K, and writes K and V into the
flat cache rows of slot_mapping (quantised to E4M3 with their scales where the cache is fp8, kv_fp8.py). Beyond a
few dozen rows cuBLAS's GEMM is faster than the fused kernel's (H200, LLaDA-8B: 0.65 against 0.96 ms at 4,608
rows), and this pass moves only the projection's few MB, so `qkv_rope` (fused_qkv_rope.py) picks this path there.
The projection may be an FP8 GEMM's unscaled product: the pass applies its row and column scales and the bias
first (`dequant`), which saves a launch.
"""
from __future__ import annotations

import functools

import torch

from .fp8 import ScaledProduct, dequantize_ref, quantize_rows_ref
from .kv_fp8 import scale_arguments

try:
    import triton
    import triton.language as tl

    from .fp8 import quantized, scale_of
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


@functools.cache
def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[head_dim // 2] fp32, the same expression as models/llada.py's rotary_cos_sin, so that the
    angles position * inv_freq are bit-identical to the model's."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return 1.0 / (theta ** exponent)


def rope_cache_write_ref(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, rope_theta: float,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         dequant: tuple[torch.Tensor, torch.Tensor] | None = None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [N, (H + 2 Hkv) * D] (q|k|v columns); positions, slot_mapping [N]; k_cache, v_cache [rows, Hkv, D]
    -> q [N, H, D] rotated, in qkv's dtype. Writes rotated K and V into the cache at slot_mapping.
    Rotate-half RoPE in fp32, as LLaDABlock.cached_attention does.

    k_scale, v_scale [rows, Hkv] fp32 (an fp8 cache): K and V are stored as quantize_rows_ref gives them (a row a
    KV head), their scales beside them.
    dequant (row_scale [N], col_scale [F]) and bias [F] (F = qkv's columns): the projection is
    ((qkv * row_scale) * col_scale + bias) in fp32, rounded to qkv's dtype (an FP8 GEMM's unscaled product).
    """
    N, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[1:]
    if dequant is not None:
        qkv = dequantize_ref(ScaledProduct(qkv, *dequant, bias), qkv.dtype)
    elif bias is not None:
        qkv = (qkv.float() + bias.float()).to(qkv.dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    freqs = positions.float()[:, None] * rope_inv_freq(head_dim, rope_theta, qkv.device)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]                        # [N, 1, D / 2]

    def rotate(t: torch.Tensor, heads: int) -> torch.Tensor:
        t1, t2 = t.reshape(N, heads, head_dim).float().chunk(2, dim=-1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(qkv.dtype)

    for cache, scale, rows in ((k_cache, k_scale, rotate(k, num_kv_heads)),
                               (v_cache, v_scale, v.reshape(N, num_kv_heads, head_dim))):
        if scale is None:
            cache.index_copy_(0, slot_mapping, rows)
        else:
            values, row_scale = quantize_rows_ref(rows)
            cache.view(torch.uint8).index_copy_(0, slot_mapping, values.view(torch.uint8))  # no fp8 index_copy_
            scale.index_copy_(0, slot_mapping, row_scale)
    return rotate(q, num_heads)


def rope_cache_write(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, rope_theta: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     dequant: tuple[torch.Tensor, torch.Tensor] | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of rope_cache_write_ref (same arguments, same result)."""
    if triton is None:
        raise RuntimeError("rope_cache_write needs triton; use rope_cache_write_ref")
    N, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[1:]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    q = torch.empty(N, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if N == 0:
        return q
    fp8 = scale_arguments(k_cache, v_cache, k_scale, v_scale)
    row_scale, col_scale = dequant if dequant is not None else (qkv, qkv)  # unread without DEQUANT
    half = head_dim // 2
    block_n = 16
    grid = (triton.cdiv(N, block_n), num_heads + 2 * num_kv_heads)
    _rope_cache_write_kernel[grid](
        qkv, positions, rope_inv_freq(head_dim, rope_theta, qkv.device), slot_mapping, q, k_cache, v_cache,
        *fp8.pointers, row_scale, col_scale, bias if bias is not None else qkv,
        N, half, qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), *fp8.strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, KV_FP8=fp8.on, DEQUANT=dequant is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_HALF=max(16, triton.next_power_of_2(half)), num_warps=4,
        # each scaling and the bias rounded on its own, as in the reference
        enable_fp_fusion=dequant is None and bias is None)
    return q


if triton is not None:
    @triton.jit
    def _store_halves(p_out, b_1, b_2, half, m_out):
        """A head's rotate-half pair of column blocks: b_1 at columns j, b_2 at j + half."""
        tl.store(p_out, b_1.to(p_out.dtype.element_ty), mask=m_out)
        tl.store(p_out + half, b_2.to(p_out.dtype.element_ty), mask=m_out)

    @triton.jit
    def rotate_and_store(b_1, b_2, head, o_n, o_j, N, half, pos_ptr, inv_freq_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                         ks_ptr, vs_ptr, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_ksn, stride_vsn, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         KV_FP8: tl.constexpr):
        """Head `head` of q|k|v at rows o_n, as fp32 column pairs (b_1 at columns o_j, b_2 at o_j + half):
        q and k heads rotated by RoPE at the rows' positions; q stored to its rows, k and v to the cache rows
        of slot_mapping. KV_FP8: k and v quantised to E4M3 with their scales (stored at ks_ptr, vs_ptr
        [rows, Hkv]), which takes the whole head in b_1, b_2. Shared by both kernels of the QKV path."""
        m_n, m_j = o_n < N, o_j < half
        m = m_n[:, None] & m_j[None, :]
        if head < NUM_HEADS + NUM_KV_HEADS:  # q and k heads are rotated, v heads are not
            b_pos = tl.load(pos_ptr + o_n, mask=m_n, other=0).to(tl.float32)
            b_freq = b_pos[:, None] * tl.load(inv_freq_ptr + o_j, mask=m_j, other=0.0)[None, :]
            b_cos, b_sin = tl.cos(b_freq), tl.sin(b_freq)
            b_1, b_2 = b_1 * b_cos - b_2 * b_sin, b_2 * b_cos + b_1 * b_sin
        if head < NUM_HEADS:
            _store_halves(q_ptr + o_n[:, None] * stride_qn + head * stride_qh + o_j[None, :], b_1, b_2, half, m)
        else:
            b_slot = tl.load(slot_ptr + o_n, mask=m_n, other=0)
            kv_head = (head - NUM_HEADS) % NUM_KV_HEADS
            if head < NUM_HEADS + NUM_KV_HEADS:
                p_out = k_ptr + b_slot[:, None] * stride_kn + kv_head * stride_kh + o_j[None, :]
                p_scale = ks_ptr + b_slot * stride_ksn + kv_head
            else:
                p_out = v_ptr + b_slot[:, None] * stride_vn + kv_head * stride_vh + o_j[None, :]
                p_scale = vs_ptr + b_slot * stride_vsn + kv_head
            if KV_FP8:  # quantised from the value a cache in the model's dtype (q's) would hold
                b_1 = b_1.to(q_ptr.dtype.element_ty).to(tl.float32)
                b_2 = b_2.to(q_ptr.dtype.element_ty).to(tl.float32)
                b_scale = scale_of(tl.maximum(tl.max(tl.abs(b_1), 1), tl.max(tl.abs(b_2), 1)))
                b_1, b_2 = quantized(b_1, b_scale[:, None]), quantized(b_2, b_scale[:, None])
                tl.store(p_scale, b_scale, mask=m_n)
            _store_halves(p_out, b_1, b_2, half, m)

    @triton.jit(do_not_specialize=["N"])  # the row count varies by step: no recompilation per N % 16
    def _rope_cache_write_kernel(
            qkv_ptr, pos_ptr, inv_freq_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, row_ptr, col_ptr,
            bias_ptr, N, half, stride_xn, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
            stride_ksn, stride_vsn, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_FP8: tl.constexpr,
            DEQUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # One program: BLOCK_N rows x one head of q|k|v; column j and its rotate-half partner j + half.
        pid_n, head = tl.program_id(0), tl.program_id(1)
        o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_j = tl.arange(0, BLOCK_HALF)
        m_n, m_j = o_n < N, o_j < half
        m = m_n[:, None] & m_j[None, :]
        f_1 = head * 2 * half + o_j                                             # the head's first-half columns
        p_in = qkv_ptr + o_n[:, None] * stride_xn + f_1[None, :]
        b_1 = tl.load(p_in, mask=m, other=0.0).to(tl.float32)
        b_2 = tl.load(p_in + half, mask=m, other=0.0).to(tl.float32)
        if DEQUANT:  # (values * row scale) * column scale
            b_row = tl.load(row_ptr + o_n, mask=m_n, other=0.0)[:, None]
            b_1 = b_1 * b_row * tl.load(col_ptr + f_1, mask=m_j, other=0.0)[None, :]
            b_2 = b_2 * b_row * tl.load(col_ptr + f_1 + half, mask=m_j, other=0.0)[None, :]
        if HAS_BIAS:
            b_1 += tl.load(bias_ptr + f_1, mask=m_j, other=0.0).to(tl.float32)[None, :]
            b_2 += tl.load(bias_ptr + f_1 + half, mask=m_j, other=0.0).to(tl.float32)[None, :]
        if DEQUANT or HAS_BIAS:  # the reference rotates the projection rounded to its dtype
            b_1 = b_1.to(qkv_ptr.dtype.element_ty).to(tl.float32)
            b_2 = b_2.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        rotate_and_store(b_1, b_2, head, o_n, o_j, N, half, pos_ptr, inv_freq_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                         ks_ptr, vs_ptr, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_ksn, stride_vsn, NUM_HEADS, NUM_KV_HEADS, KV_FP8)
