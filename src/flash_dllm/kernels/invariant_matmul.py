"""x @ w.T with every output row's sums in one order, whatever the number of rows (Triton), beside its reference.

cuBLAS picks its kernel, tile and split over K by the shape, so the same row comes out rounded differently in a
batch of 1 and of 32 (issue 16). Here K is never split: program (row tile, column tile) walks K left to right
with an fp32 accumulator, and the tensor cores add one 16-wide K slice per instruction into it, so an output
element is the same chain of additions whatever the tile's rows, columns or K step. The tiling can then follow
the number of rows (few rows: narrow column tiles, so that every SM streams weights; many: large tiles), and a
row's result still depends only on the row and the weights; it is also the same from run to run.
`benchmarks/invariant_matmul_configs.py` checks that on the GPU (every config bit-identical) and picks them.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None

# (most rows, tiling) per dtype, first match; tuned on the H200 at LLaDA-8B's shapes. fp32 (FMA, not tensor
# cores) sums each element in K order under any tiling too.
CONFIGS = {
    torch.bfloat16: [(64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)),
                     (None, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4))],
    torch.float32: [(None, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3))],
}
CONFIGS[torch.float16] = CONFIGS[torch.bfloat16]
GROUP_M = 8  # row tiles that walk the column tiles together (weight tiles reused from L2)


def invariant_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T -> [..., N] in x's dtype, fp32 sums (F.linear without bias)."""
    return (x.float() @ w.float().T).to(x.dtype)


def config_for(rows: int, dtype: torch.dtype) -> dict:
    return next(config for most, config in CONFIGS[dtype] if most is None or rows <= most)


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
    config = config or config_for(M, x.dtype)
    grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]),)
    _invariant_matmul_kernel[grid](a, w, out, M, N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                                   GROUP_M=GROUP_M, EVEN_K=K % config["BLOCK_K"] == 0, DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1", **config)
    return out.view(*x.shape[:-1], N)


if triton is not None:
    # M varies by step: not specialised on (M % 16 or M == 1 would compile, and possibly round, differently).
    @triton.jit(do_not_specialize=["M", "stride_am"])
    def _invariant_matmul_kernel(a_ptr, w_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_wk, stride_om,
                                 GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
        # Grouped order: GROUP_M row tiles take the column tiles in turn, so a weight tile is read from HBM once
        # per group. The order decides only which program runs when, never how a row is summed.
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        group_size = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
        tile_n = (pid % (GROUP_M * tiles_n)) // group_size
        o_m = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        o_n = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        o_k = tl.arange(0, BLOCK_K)
        m_m, m_n = o_m < M, o_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):  # left to right, one BLOCK_K step at a time
            m_k = (k + o_k) < K if not EVEN_K else tl.full([BLOCK_K], 1, tl.int1)  # constant: no K test
            b_a = tl.load(a_ptr + o_m[:, None] * stride_am + (k + o_k)[None, :], mask=m_m[:, None] & m_k[None, :],
                          other=0.0)
            b_w = tl.load(w_ptr + o_n[None, :] * stride_wn + (k + o_k)[:, None] * stride_wk,
                          mask=m_n[None, :] & m_k[:, None], other=0.0)
            if DOT_FP32:  # the interpreter's 16-bit tl.dot is wrong: exact fp32 products there
                b_a, b_w = b_a.to(tl.float32), b_w.to(tl.float32)
            acc = tl.dot(b_a, b_w, acc, input_precision="ieee")
        tl.store(out_ptr + o_m[:, None] * stride_om + o_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_m[:, None] & m_n[None, :])
