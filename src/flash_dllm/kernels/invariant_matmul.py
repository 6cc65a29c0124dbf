"""x @ w.T with every output row's sums in one order, whatever the number of rows (Triton), beside its reference.

cuBLAS picks its kernel, tile and split over K by the shape, so the same row comes out rounded differently in a
batch of 1 and of 32 (issue 16). Here K is never split: program (row tile, column tile) walks K left to right
with an fp32 accumulator, and the tensor cores add one 16-wide K slice per instruction into it, so an output
element is the same chain of additions whatever the tile's rows, columns or K step. The tiling can then follow
the number of rows (few rows: narrow column tiles, so that every SM streams weights; 98-144: one row tile of 128
plus a tail of 16, each weight tile loaded once; many: large tiles), and a row's result still depends only on
the row and the weights; it is also the same from run to run.
`benchmarks/invariant_matmul_configs.py` checks that on the GPU (every config bit-identical) and picks them.
(A split over K fixed by the weight's shape was measured: no faster at 144 rows, 1.4-1.5x slower at 241 rows and
at batch 32; H200, benchmarks/HISTORY.md.) Also a batched matmul and a row sum with the same property, for sums over a
batch-padded axis (Elastic-Cache's drift test).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None

# Per dtype, (most rows, tiling, narrow tiling) entries, the first that fits is used; the narrow tiling (where
# there is one) is for GEMMs with no more outputs than inputs (o_proj, down_proj), whose few column tiles want more
# row tiles to fill the GPU. Picked on the H200 at LLaDA-8B's shapes by benchmarks/invariant_matmul_configs.py
# --write. fp32 (FMA, not tensor cores) sums in K order under any tiling.
CONFIGS = {getattr(torch, dtype): [(most, config, narrow[0] if narrow else None) for most, config, *narrow in table]
           for dtype, table in json.loads((Path(__file__).parent / "invariant_matmul.json").read_text()).items()}
GROUP_M = 8  # row tiles that walk the column tiles together (weight tiles reused from L2)
# The one tiling of invariant_bmm (any tiling gives the same bits; one K step per dtype, as in CONFIGS).
BMM_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)


def invariant_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T -> [..., N] in x's dtype, fp32 sums (F.linear without bias)."""
    return (x.float() @ w.float().T).to(x.dtype)


def config_for(rows: int, dtype: torch.dtype, narrow: bool = False) -> dict:
    _, config, narrow_config = next(entry for entry in CONFIGS[dtype] if entry[0] is None or rows <= entry[0])
    return narrow_config if narrow and narrow_config else config


def invariant_matmul(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The Triton kernel of invariant_matmul_ref (same arguments, same result within rounding); row i of the
    result is bit-identical for any number of rows. Graph capturable: no host syncs. config: a tiling other
    than the table's (the config search)."""
    if triton is None:
        raise RuntimeError("invariant_matmul needs triton; use invariant_matmul_ref")
    K = x.shape[-1]
    assert w.shape[1] == K and w.dtype == x.dtype
    a = x.reshape(-1, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    M, N = a.shape[0], w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    config = {"SWAP": False, "TAIL": 0, **(config or config_for(M, x.dtype, narrow=N <= K))}
    assert config["SWAP"] or not config["TAIL"], "a tail tile needs SWAP"
    grid = (triton.cdiv(M, config["BLOCK_M"] + config["TAIL"]) * triton.cdiv(N, config["BLOCK_N"]),)
    if w.stride(1) != 1:
        w = w.contiguous()
    dot_fp32 = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _invariant_matmul_kernel[grid](a, w, out, M, N, K, a.stride(0), w.stride(0), out.stride(0), GROUP_M=GROUP_M,
                                   EVEN_K=K % config["BLOCK_K"] == 0, DOT_FP32=dot_fp32, **config)
    return out.view(*x.shape[:-1], N)


def invariant_bmm_ref(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] -> [G, M, N] in out_dtype (default a's), fp32 sums."""
    return (a.float() @ b.float()).to(out_dtype or a.dtype)


def invariant_bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Triton kernel of invariant_bmm_ref: one program per (group, tile), K walked left to right in one K step
    per dtype, never split, so element (g, i, j) is one chain of additions whatever G, M or N, and whatever K
    beyond the last nonzero product (exact zeros added to it leave it unchanged: a key axis padded to the batch's
    longest row sums the same alone and in a batch). Any strides (b may be expanded over G). Graph capturable."""
    if triton is None:
        raise RuntimeError("invariant_bmm needs triton; use invariant_bmm_ref")
    (G, M, K), N = a.shape, b.shape[2]
    assert b.shape[:2] == (G, K) and b.dtype == a.dtype
    out = torch.empty(G, M, N, dtype=out_dtype or a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    config = dict(BMM_CONFIG, BLOCK_K=config_for(1, a.dtype)["BLOCK_K"])
    if N <= 16:  # a row sum (invariant_sum): the narrowest column tile tl.dot takes
        config.update(BLOCK_M=64, BLOCK_N=16)
    grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]), G)
    dot_fp32 = a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _invariant_bmm_kernel[grid](a, b, out, M, N, K, *a.stride(), *b.stride(), *out.stride(), DOT_FP32=dot_fp32,
                                **config)
    return out


def invariant_sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [...] fp32: the sum over the last axis in one order (invariant_bmm against ones), whatever
    the leading shape, and unchanged by exact zeros appended to K (a batch's padding, masked to zero)."""
    K = x.shape[-1]
    a = x if x.dim() == 3 else x.reshape(1, -1, K)  # 3-D: read in place, any strides
    ones = torch.ones(1, K, 1, dtype=x.dtype, device=x.device).expand(a.shape[0], K, 1)
    return invariant_bmm(a, ones, torch.float32).view(x.shape[:-1])


if triton is not None:
    # M varies by step and is not specialised on (one compile for every row count); the strides are (their
    # divisibility lets the loads vectorise).
    @triton.jit(do_not_specialize=["M"])
    def _invariant_matmul_kernel(a_ptr, w_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
                                 GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, SWAP: tl.constexpr, TAIL: tl.constexpr,
                                 EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
        # Grouped order: GROUP_M row tiles take the column tiles in turn, so a weight tile is read from HBM once
        # per group. The order decides only which program runs when, never how a row is summed.
        # A row tile is BLOCK_M rows, then (SWAP only) TAIL more in a second accumulator: 144 rows as 128 + 16 load
        # each weight tile once for all of them, without the compute of 256 (a wider tile) or the weight reads of 3.
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M + TAIL), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        group_size = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
        tile_n = (pid % (GROUP_M * tiles_n)) // group_size
        o_m = tile_m * (BLOCK_M + TAIL) + tl.arange(0, BLOCK_M)
        o_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_k = tl.arange(0, BLOCK_K)
        m_m = o_m < M
        w_rows = tl.where(o_n < N, o_n, 0).to(tl.int64) * stride_wn  # columns past the end read column 0
        if SWAP:  # few rows: the weight tile is the product's rows, the input rows its columns (out.T per tile)
            a_ptrs = a_ptr + o_m.to(tl.int64)[None, :] * stride_am + o_k[:, None]
            w_ptrs = w_ptr + w_rows[:, None] + o_k[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            if TAIL > 0:
                o_t = tile_m * (BLOCK_M + TAIL) + BLOCK_M + tl.arange(0, TAIL)
                m_t = o_t < M
                t_ptrs = a_ptr + o_t.to(tl.int64)[None, :] * stride_am + o_k[:, None]
                acc_t = tl.zeros([BLOCK_N, TAIL], dtype=tl.float32)
        else:
            a_ptrs = a_ptr + o_m.to(tl.int64)[:, None] * stride_am + o_k[None, :]
            w_ptrs = w_ptr + w_rows[None, :] + o_k[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):  # left to right, one BLOCK_K step at a time
            in_k = o_k < K - k * BLOCK_K
            if SWAP:
                if EVEN_K:  # the weights' loads unmasked
                    b_w, b_a = tl.load(w_ptrs), tl.load(a_ptrs, mask=m_m[None, :], other=0.0)
                else:
                    b_w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
                    b_a = tl.load(a_ptrs, mask=m_m[None, :] & in_k[:, None], other=0.0)
                left, right = b_w, b_a
            else:
                if EVEN_K:
                    b_w, b_a = tl.load(w_ptrs), tl.load(a_ptrs, mask=m_m[:, None], other=0.0)
                else:
                    b_w = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
                    b_a = tl.load(a_ptrs, mask=m_m[:, None] & in_k[None, :], other=0.0)
                left, right = b_a, b_w
            if DOT_FP32:  # fp32 operands (exact products: no tf32); the interpreter's 16-bit tl.dot is wrong
                acc = tl.dot(left.to(tl.float32), right.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(left, right, acc)
            if TAIL > 0:
                if EVEN_K:
                    b_t = tl.load(t_ptrs, mask=m_t[None, :], other=0.0)
                else:
                    b_t = tl.load(t_ptrs, mask=m_t[None, :] & in_k[:, None], other=0.0)
                if DOT_FP32:
                    acc_t = tl.dot(b_w.to(tl.float32), b_t.to(tl.float32), acc_t, input_precision="ieee")
                else:
                    acc_t = tl.dot(b_w, b_t, acc_t)
                t_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = acc.to(out_ptr.dtype.element_ty)
        o_m64 = o_m.to(tl.int64)
        if SWAP:
            tl.store(out_ptr + o_m64[None, :] * stride_om + o_n[:, None], out, mask=m_m[None, :] & (o_n < N)[:, None])
            if TAIL > 0:
                tl.store(out_ptr + o_t.to(tl.int64)[None, :] * stride_om + o_n[:, None],
                         acc_t.to(out_ptr.dtype.element_ty), mask=m_t[None, :] & (o_n < N)[:, None])
        else:
            tl.store(out_ptr + o_m64[:, None] * stride_om + o_n[None, :], out, mask=m_m[:, None] & (o_n < N)[None, :])

    @triton.jit(do_not_specialize=["M", "N", "K"])
    def _invariant_bmm_kernel(a_ptr, b_ptr, out_ptr, M, N, K, stride_ag, stride_am, stride_ak, stride_bg,
                              stride_bk, stride_bn, stride_og, stride_om, stride_on, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        # program (tile, group): out[g, tile] = a[g, rows, :] @ b[g, :, columns], K left to right
        tiles_n = tl.cdiv(N, BLOCK_N)
        tile, g = tl.program_id(0), tl.program_id(1).to(tl.int64)
        o_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        o_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        o_k = tl.arange(0, BLOCK_K)
        m_m, m_n = o_m < M, o_n < N
        a_ptrs = a_ptr + g * stride_ag + o_m.to(tl.int64)[:, None] * stride_am + o_k.to(tl.int64)[None, :] * stride_ak
        b_ptrs = b_ptr + g * stride_bg + o_k.to(tl.int64)[:, None] * stride_bk + o_n.to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            in_k = o_k < K - k * BLOCK_K
            b_a = tl.load(a_ptrs, mask=m_m[:, None] & in_k[None, :], other=0.0)
            b_b = tl.load(b_ptrs, mask=in_k[:, None] & m_n[None, :], other=0.0)
            if DOT_FP32:
                acc = tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(b_a, b_b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        p_out = out_ptr + g * stride_og + o_m.to(tl.int64)[:, None] * stride_om + o_n.to(tl.int64)[None, :] * stride_on
        tl.store(p_out, acc.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])
