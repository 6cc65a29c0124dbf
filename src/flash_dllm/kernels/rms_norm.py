"""RMSNorm (Triton), beside its PyTorch reference.

In PyTorch the fp32 norm is about six launches (pow, mean, add, rsqrt, mul, cast) plus the scale and the bias;
the kernel is one launch that reads each row once and writes it once, with the reference's rounding order.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., d]; weight, bias [d] -> [..., d] (x's dtype when weight and bias have it).

    Normalise in fp32, cast back, then scale: the order of LLaDA's reference implementation. With 16-bit x,
    weight * x and + bias are each rounded to x's dtype (PyTorch computes each in fp32 and rounds once)."""
    x32 = x.float()
    x = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * x if bias is None else weight * x + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
             invariant: bool = False) -> torch.Tensor:
    """The Triton kernel of rms_norm_ref (same arguments, same result). Graph capturable: no host syncs.
    invariant: one row per program whatever the row count, so that a row is summed the same way in any batch
    (several rows a program when d is small would change the warps, and the sum's order, with the count)."""
    if triton is None:
        raise RuntimeError("rms_norm needs triton; use rms_norm_ref")
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.dtype == x.dtype  # else PyTorch would promote weight * x
    assert bias is None or (bias.shape == (d,) and bias.dtype == x.dtype)
    x2 = x.reshape(-1, d)
    assert x2.stride(-1) == weight.stride(0) == 1 and (bias is None or bias.stride(0) == 1)
    N = x2.shape[0]
    out = torch.empty(N, d, dtype=x.dtype, device=x.device)
    if N == 0:
        return out.view(x.shape)
    block_d = triton.next_power_of_2(d)
    block_n = 1 if invariant else min(triton.next_power_of_2(N), max(1, 4096 // block_d))  # rows a program
    _rms_norm_kernel[(triton.cdiv(N, block_n),)](
        x2, weight, bias if bias is not None else weight, out, N, x2.stride(0), out.stride(0), d, eps,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=max(1, min(8, block_n * block_d // 256)),
        enable_fp_fusion=False)  # no fma of weight * x + bias in fp32: PyTorch rounds the product first
    return out.view(x.shape)


if triton is not None:
    @triton.jit(do_not_specialize=["N"])  # the row count varies by step: no recompilation per N % 16
    def _rms_norm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, stride_xn, stride_on, d, eps,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program: BLOCK_N whole rows, kept in registers between the sum of squares and the scaling.
        o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < d
        m = (o_n < N)[:, None] & m_d[None, :]
        b_x = tl.load(x_ptr + o_n[:, None] * stride_xn + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        # Correctly rounded sqrt and division (tl.rsqrt is approximate); once per row, so free.
        b_r = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(b_x * b_x, 1) / d + eps))
        # Round the normalised row to x's dtype, then weight * x rounded, then + bias rounded, as PyTorch.
        b_y = (b_x * b_r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        b_y = b_y * tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            b_bias = tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_y = b_y.to(x_ptr.dtype.element_ty).to(tl.float32) + b_bias[None, :]
        tl.store(out_ptr + o_n[:, None] * stride_on + o_d[None, :], b_y.to(out_ptr.dtype.element_ty), mask=m)
