"""Fused QKV projection + rotary embedding + KV cache write (Triton), beside its PyTorch reference.

One launch turns the normed hidden rows into Q (returned) and writes K (rotated) and V straight into the
flat cache rows of slot_mapping, so no K/V tensor is ever stored in between (quantised to E4M3 with their scales
where the cache is fp8, kv_fp8.py). A pass that must not write the cache (the verify pass) passes fresh
[N, Hkv, D] buffers in the model's dtype (beside an fp8 cache too) and slot_mapping = arange(N). `qkv_rope`,
which the model calls, uses it up to FUSED_MAX_ROWS rows and cuBLAS's GEMM + rope_cache_write beyond.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .invariant_matmul import invariant_matmul
from .kv_fp8 import scale_arguments
from .rope_cache_write import rope_cache_write, rope_cache_write_ref, rope_inv_freq

try:
    import triton
    import triton.language as tl

    from .rope_cache_write import rotate_and_store
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def fused_qkv_rope_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                       rope_theta: float, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, d]; weight [(H + 2 Hkv) * D, d] (q|k|v rows), bias [(H + 2 Hkv) * D] or None; positions,
    slot_mapping [N]; k_cache, v_cache [rows, Hkv, D] -> q [N, H, D] in x's dtype.

    Writes rotated K and V into the cache at slot_mapping. Rotate-half RoPE in fp32 on the projection
    rounded to x's dtype, as LLaDABlock.cached_attention does. k_scale, v_scale [rows, Hkv] fp32: an fp8 cache
    (rope_cache_write_ref's).
    """
    return rope_cache_write_ref(F.linear(x, weight, bias), positions, slot_mapping, k_cache, v_cache, num_heads,
                                rope_theta, k_scale, v_scale)


# Rows up to which the fused kernel beats cuBLAS's GEMM + the rope_cache_write epilogue (H200, LLaDA-8B:
# 0.039 ms each at 32 rows; at 144 rows 0.10 ms against 0.04 + the epilogue).
FUSED_MAX_ROWS = 64


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
             slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
             rope_theta: float, invariant: bool = False, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fused_qkv_rope_ref by the faster kernels for this many rows: the fused kernel for a few, else the
    GEMM and the epilogue kernel. invariant: the batch-invariant GEMM and the epilogue, at any row count."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if invariant:
        qkv = invariant_matmul(x, weight)
        return rope_cache_write(qkv if bias is None else qkv + bias, positions, slot_mapping, k_cache, v_cache,
                                num_heads, rope_theta, **scales)
    if x.shape[0] <= FUSED_MAX_ROWS:
        return fused_qkv_rope(x, weight, bias, positions, slot_mapping, k_cache, v_cache, num_heads, rope_theta,
                              **scales)
    return rope_cache_write(F.linear(x, weight, bias), positions, slot_mapping, k_cache, v_cache, num_heads,
                            rope_theta, **scales)


SHARED_MEMORY_BYTES = 160 * 1024  # of the H200's 227 KB per block, with room for the epilogue's layout changes


def launch_config(num_rows: int, half: int, whole_heads: bool = False, fp32: bool = False) -> dict:
    """Tile sizes by row count, tuned on the H200 at LLaDA-8B shapes (benchmarks/tune_kernels.py). whole_heads:
    a program holds whole heads (an fp8 cache's scale is the amax of a head; not tuned)."""
    block_half = max(16, triton.next_power_of_2(half))
    if num_rows <= 32:  # heads in chunks, to put more programs on the SMs
        config = dict(BLOCK_N=max(16, triton.next_power_of_2(num_rows)),
                      BLOCK_HALF=block_half if whole_heads else min(16, block_half), BLOCK_K=128, num_warps=4)
    else:
        config = dict(BLOCK_N=min(128, triton.next_power_of_2(num_rows)), BLOCK_HALF=block_half, BLOCK_K=64,
                      num_warps=8)
    # as many pipeline stages (up to 4) as the x and two weight tiles fit in shared memory (fp32 whole heads: 2)
    stage_bytes = (config["BLOCK_N"] + 2 * config["BLOCK_HALF"]) * config["BLOCK_K"] * (4 if fp32 else 2)
    return dict(config, num_stages=max(1, min(4, SHARED_MEMORY_BYTES // stage_bytes)))


def fused_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   rope_theta: float, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of fused_qkv_rope_ref (same arguments, same result)."""
    if triton is None:
        raise RuntimeError("fused_qkv_rope needs triton; use fused_qkv_rope_ref")
    (N, d), (num_kv_heads, head_dim) = x.shape, k_cache.shape[1:]
    assert weight.shape == ((num_heads + 2 * num_kv_heads) * head_dim, d) and weight.dtype == x.dtype
    assert x.stride(-1) == weight.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    q = torch.empty(N, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if N == 0:
        return q
    fp8 = scale_arguments(k_cache, v_cache, k_scale, v_scale)
    half = head_dim // 2
    config = launch_config(N, half, whole_heads=fp8.on, fp32=x.dtype == torch.float32)
    chunks = triton.cdiv(half, config["BLOCK_HALF"])
    grid = (triton.cdiv(N, config["BLOCK_N"]), (num_heads + 2 * num_kv_heads) * chunks)
    _fused_qkv_rope_kernel[grid](
        x, weight, bias if bias is not None else weight, positions, rope_inv_freq(head_dim, rope_theta, x.device),
        slot_mapping, q, k_cache, v_cache, *fp8.pointers,
        N, d, half, x.stride(0), weight.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), *fp8.strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HAS_BIAS=bias is not None, CHUNKS=chunks, KV_FP8=fp8.on,
        DOT_FP32=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1", **config)
    return q


if triton is not None:
    @triton.jit
    def _dot(a, b, acc, DOT_FP32: tl.constexpr):
        if DOT_FP32:  # exact fp32 products; also the interpreter's path, whose 16-bit tl.dot is wrong
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision="ieee")

    @triton.jit(do_not_specialize=["N"])  # the row count varies by step: no recompilation per N % 16
    def _fused_qkv_rope_kernel(
            x_ptr, w_ptr, bias_ptr, pos_ptr, inv_freq_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
            N, d, half, stride_xn, stride_wf, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
            stride_ksn, stride_vsn, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr,
            CHUNKS: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_HALF: tl.constexpr, DOT_FP32: tl.constexpr):
        # One program: BLOCK_N rows x one chunk of BLOCK_HALF column pairs of a head of the packed q|k|v output
        # (heads 0..H-1 are q, then k, then v). Column j and its rotate-half partner j + half get their own
        # accumulators, so a chunk holds whole pairs.
        pid_n, pid_h = tl.program_id(0), tl.program_id(1)
        head, chunk = pid_h // CHUNKS, pid_h % CHUNKS
        o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_j = chunk * BLOCK_HALF + tl.arange(0, BLOCK_HALF)
        o_k = tl.arange(0, BLOCK_K)
        m_n, m_j = o_n < N, o_j < half
        f_1 = head * 2 * half + o_j                                             # weight rows, first half
        b_1 = tl.zeros([BLOCK_N, BLOCK_HALF], dtype=tl.float32)
        b_2 = tl.zeros([BLOCK_N, BLOCK_HALF], dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            m_k = k0 + o_k < d
            b_x = tl.load(x_ptr + o_n[:, None] * stride_xn + (k0 + o_k)[None, :],
                          mask=m_n[:, None] & m_k[None, :], other=0.0)
            p_w = w_ptr + f_1[:, None] * stride_wf + (k0 + o_k)[None, :]
            m_w = m_j[:, None] & m_k[None, :]
            b_w1 = tl.load(p_w, mask=m_w, other=0.0)
            b_w2 = tl.load(p_w + half * stride_wf, mask=m_w, other=0.0)
            b_1 = _dot(b_x, tl.trans(b_w1), b_1, DOT_FP32)
            b_2 = _dot(b_x, tl.trans(b_w2), b_2, DOT_FP32)
        if HAS_BIAS:
            b_1 += tl.load(bias_ptr + f_1, mask=m_j, other=0.0).to(tl.float32)[None, :]
            b_2 += tl.load(bias_ptr + f_1 + half, mask=m_j, other=0.0).to(tl.float32)[None, :]
        # The reference rotates the projection after rounding it to the input dtype.
        b_1 = b_1.to(x_ptr.dtype.element_ty).to(tl.float32)
        b_2 = b_2.to(x_ptr.dtype.element_ty).to(tl.float32)
        rotate_and_store(b_1, b_2, head, o_n, o_j, N, half, pos_ptr, inv_freq_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                         ks_ptr, vs_ptr, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_ksn, stride_vsn, NUM_HEADS, NUM_KV_HEADS, KV_FP8)
