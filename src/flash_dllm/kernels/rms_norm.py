"""RMSNorm (Triton), beside its PyTorch reference.

In PyTorch the fp32 norm is about six launches (pow, mean, add, rsqrt, mul, cast) plus the scale and the bias;
the kernel is one launch that reads each row once and writes it once, with the reference's rounding order. With FP8
weights (rms_norm_fp8) it also quantises its output for the next GEMM and can first add the previous GEMM's
ScaledProduct to the residual stream: three of the PyTorch path's steps in one launch.
"""
from __future__ import annotations

import torch

from .fp8 import FP8, Fp8Rows, ScaledProduct, add_dequantized_ref, quantize_rows_ref

try:
    import triton
    import triton.language as tl

    from .fp8 import quantized, scale_of
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., d]; weight, bias [d] -> [..., d] (x's dtype when weight and bias have it).

    Normalise in fp32, cast back, then scale: the order of LLaDA's reference implementation. With 16-bit x,
    weight * x and + bias are each rounded to x's dtype (PyTorch computes each in fp32 and rounds once)."""
    x32 = x.float()
    x = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * x if bias is None else weight * x + bias


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                     residual: ScaledProduct | None = None) -> tuple[torch.Tensor, Fp8Rows]:
    """x [M, d] (+ the rows of `residual`, an FP8 GEMM's output, added as add_dequantized_ref adds them) -> that sum
    [M, d] and its rms_norm_ref quantised per row (the next FP8 GEMM's input)."""
    if residual is not None:
        x = add_dequantized_ref(x, residual)
    return x, quantize_rows_ref(rms_norm_ref(x, weight, bias, eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
             invariant: bool = False) -> torch.Tensor:
    """The Triton kernel of rms_norm_ref (same arguments, same result). Graph capturable: no host syncs.
    invariant: one row per program whatever the row count, so that a row is summed the same way in any batch
    (several rows a program when d is small would change the warps, and the sum's order, with the count)."""
    if triton is None:
        raise RuntimeError("rms_norm needs triton; use rms_norm_ref")
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    _launch(x2, weight, bias, eps, out, None, None, x2, 1 if invariant else None)
    return out.view(x.shape)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                 residual: ScaledProduct | None = None) -> tuple[torch.Tensor, Fp8Rows]:
    """The Triton kernel of rms_norm_fp8_ref (same arguments, same result), one launch. x [M, d]."""
    if triton is None:
        raise RuntimeError("rms_norm_fp8 needs triton; use rms_norm_fp8_ref")
    M, d = x.shape
    out = Fp8Rows(torch.empty(M, d, dtype=FP8, device=x.device), torch.empty(M, dtype=torch.float32, device=x.device))
    summed = x if residual is None else torch.empty(M, d, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, eps, out.values, out.scale, residual, summed)
    return summed, out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, out: torch.Tensor,
            out_scale: torch.Tensor | None, residual: ScaledProduct | None, summed: torch.Tensor,
            rows_per_program: int | None = None):
    """x [M, d] -> out [M, d] (quantised, with out_scale [M], when out_scale is given); with `residual`, x + its rows
    are normed and written to `summed` [M, d] (else unread)."""
    M, d = x.shape
    assert weight.shape == (d,) and weight.dtype == x.dtype  # else PyTorch would promote weight * x
    assert bias is None or (bias.shape == (d,) and bias.dtype == x.dtype)
    assert x.stride(-1) == weight.stride(0) == 1 and (bias is None or bias.stride(0) == 1)
    if M == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_n = rows_per_program or min(triton.next_power_of_2(M), max(1, 4096 // block_d))
    values, row_scale, col_scale, residual_bias = residual if residual is not None else (x, x, x, None)
    assert residual is None or (values.shape == (M, d) and values.stride(-1) == 1)
    _rms_norm_kernel[(triton.cdiv(M, block_n),)](
        x, weight, bias if bias is not None else weight, out, out_scale if out_scale is not None else x,
        values, row_scale, col_scale, residual_bias if residual_bias is not None else x,
        summed, M, x.stride(0), out.stride(0), values.stride(0), summed.stride(0), d, eps, HAS_BIAS=bias is not None,
        QUANTIZE=out_scale is not None, HAS_RESIDUAL=residual is not None, RESIDUAL_BIAS=residual_bias is not None,
        BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=max(1, min(8, block_n * block_d // 256)),
        enable_fp_fusion=False)  # no fma of weight * x + bias in fp32: PyTorch rounds the product first


if triton is not None:
    @triton.jit(do_not_specialize=["N"])  # the row count varies by step: no recompilation per N % 16
    def _rms_norm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, out_scale_ptr, values_ptr, row_ptr, col_ptr, res_bias_ptr,
                         sum_ptr, N, stride_xn, stride_on, stride_vn, stride_sn, d, eps,
                         HAS_BIAS: tl.constexpr, QUANTIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         RESIDUAL_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program: BLOCK_N whole rows, kept in registers between the sum of squares and the scaling.
        o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < d
        m = (o_n < N)[:, None] & m_d[None, :]
        b_x = tl.load(x_ptr + o_n[:, None] * stride_xn + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # x + the FP8 GEMM's rows, each rounded to x's dtype as add_dequantized_ref
            b_delta = tl.load(values_ptr + o_n[:, None] * stride_vn + o_d[None, :], mask=m, other=0.0).to(tl.float32)
            b_delta = b_delta * tl.load(row_ptr + o_n, mask=o_n < N, other=0.0)[:, None]
            b_delta = b_delta * tl.load(col_ptr + o_d, mask=m_d, other=0.0)[None, :]
            if RESIDUAL_BIAS:
                b_delta += tl.load(res_bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
            b_x = (b_x + b_delta.to(x_ptr.dtype.element_ty).to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + o_n[:, None] * stride_sn + o_d[None, :], b_x, mask=m)
            b_x = b_x.to(tl.float32)
        # Correctly rounded sqrt and division (tl.rsqrt is approximate); once per row, so free.
        b_r = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(b_x * b_x, 1) / d + eps))
        # Round the normalised row to x's dtype, then weight * x rounded, then + bias rounded, as PyTorch.
        b_y = (b_x * b_r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        b_y = b_y * tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            b_bias = tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_y = b_y.to(x_ptr.dtype.element_ty).to(tl.float32) + b_bias[None, :]
        if QUANTIZE:  # the normed row as x's dtype holds it, quantised as quantize_rows_ref
            b_y = b_y.to(x_ptr.dtype.element_ty).to(tl.float32)
            b_scale = scale_of(tl.max(tl.abs(b_y), 1))
            b_y = quantized(b_y, b_scale[:, None])
            tl.store(out_scale_ptr + o_n, b_scale, mask=o_n < N)
        tl.store(out_ptr + o_n[:, None] * stride_on + o_d[None, :], b_y.to(out_ptr.dtype.element_ty), mask=m)
