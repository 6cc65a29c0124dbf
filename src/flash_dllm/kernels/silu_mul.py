"""SiLU(gate) * up over the packed gate|up projection (Triton), beside its PyTorch reference.

In PyTorch that is two launches (silu, mul) and a [N, I] intermediate; the kernel reads gate_up once and
writes the product once, with the reference's rounding. With FP8 weights (silu_mul_fp8) it reads the gate|up GEMM's
ScaledProduct and writes the product quantised for the down projection.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import FP8, Fp8Rows, ScaledProduct, dequantize_ref, quantize_rows_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 I] (gate | up, as LLaDABlock's gate_up_proj packs them) -> silu(gate) * up [..., I].

    With 16-bit inputs PyTorch computes silu in fp32 and rounds it, then rounds the product again."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_fp8_ref(gate_up: ScaledProduct) -> Fp8Rows:
    """The gate|up GEMM's ScaledProduct [M, 2 I] -> silu_mul_ref of its rows (in the values' dtype), quantised per
    row."""
    return quantize_rows_ref(silu_mul_ref(dequantize_ref(gate_up, gate_up.values.dtype)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of silu_mul_ref (same argument, same result). Graph capturable: no host syncs."""
    if triton is None:
        raise RuntimeError("silu_mul needs triton; use silu_mul_ref")
    inter = gate_up.shape[-1] // 2
    assert gate_up.shape[-1] == 2 * inter
    x = gate_up.reshape(-1, 2 * inter)
    assert x.stride(-1) == 1
    N = x.shape[0]
    out = torch.empty(N, inter, dtype=x.dtype, device=x.device)
    if N == 0:
        return out.view(*gate_up.shape[:-1], inter)
    block_i = min(1024, triton.next_power_of_2(inter))
    block_n = min(triton.next_power_of_2(N), max(1, 4096 // block_i))  # several rows a program when I is small
    grid = (triton.cdiv(N, block_n), triton.cdiv(inter, block_i))
    _silu_mul_kernel[grid](x, out, N, x.stride(0), out.stride(0), inter, BLOCK_N=block_n, BLOCK_I=block_i,
                           num_warps=max(1, min(8, block_n * block_i // 256)))
    return out.view(*gate_up.shape[:-1], inter)


def silu_mul_fp8(gate_up: ScaledProduct) -> Fp8Rows:
    """The Triton kernel of silu_mul_fp8_ref (same argument, same result), one launch: a program takes a row in
    column blocks twice, for its amax and for its values (the second read from L2)."""
    if triton is None:
        raise RuntimeError("silu_mul_fp8 needs triton; use silu_mul_fp8_ref")
    values, bias = gate_up.values, gate_up.bias
    M, inter = values.shape[0], values.shape[1] // 2
    assert values.shape[1] == 2 * inter and values.stride(-1) == 1
    out = Fp8Rows(torch.empty(M, inter, dtype=FP8, device=values.device),
                  torch.empty(M, dtype=torch.float32, device=values.device))
    if M:
        _silu_mul_fp8_kernel[(M,)](
            values, gate_up.row_scale, gate_up.col_scale, bias if bias is not None else values, out.values,
            out.scale, values.stride(0), out.values.stride(0), inter, HAS_BIAS=bias is not None,
            BLOCK_I=min(2048, triton.next_power_of_2(inter)), num_warps=4,
            enable_fp_fusion=False)  # each step rounded as in the reference
    return out


if triton is not None:
    from .fp8 import dequantized, quantized, scale_of

    @triton.jit
    def _silu_mul_of(p_values, p_col, p_bias, row_scale, o_i, m_i, inter, HAS_BIAS: tl.constexpr):
        """silu(gate) * up at columns o_i of a gate|up ScaledProduct's row, rounded as silu_mul_fp8_ref."""
        dtype = p_values.dtype.element_ty
        b_gate = dequantized(p_values, p_col, p_bias, row_scale, o_i, m_i, HAS_BIAS).to(dtype).to(tl.float32)
        b_up = dequantized(p_values + inter, p_col + inter, p_bias + inter, row_scale, o_i, m_i,
                           HAS_BIAS).to(dtype).to(tl.float32)
        b_silu = tl.div_rn(b_gate, 1.0 + tl.exp(-b_gate)).to(dtype).to(tl.float32)
        return (b_silu * b_up).to(dtype).to(tl.float32)

    @triton.jit
    def _silu_mul_fp8_kernel(values_ptr, row_ptr, col_ptr, bias_ptr, out_ptr, scale_ptr, stride_vm, stride_om, inter,
                             HAS_BIAS: tl.constexpr, BLOCK_I: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p_values, row_scale = values_ptr + row * stride_vm, tl.load(row_ptr + row)
        b_amax = tl.zeros([BLOCK_I], dtype=tl.float32)
        for start in range(0, inter, BLOCK_I):
            o_i = start + tl.arange(0, BLOCK_I)
            b_out = _silu_mul_of(p_values, col_ptr, bias_ptr, row_scale, o_i, o_i < inter, inter, HAS_BIAS)
            b_amax = tl.maximum(b_amax, tl.abs(b_out))
        scale = scale_of(tl.max(b_amax, 0))
        for start in range(0, inter, BLOCK_I):
            o_i = start + tl.arange(0, BLOCK_I)
            b_out = _silu_mul_of(p_values, col_ptr, bias_ptr, row_scale, o_i, o_i < inter, inter, HAS_BIAS)
            tl.store(out_ptr + row * stride_om + o_i, quantized(b_out, scale).to(out_ptr.dtype.element_ty),
                     mask=o_i < inter)
        tl.store(scale_ptr + row, scale)

    @triton.jit(do_not_specialize=["N"])  # the row count varies by step: no recompilation per N % 16
    def _silu_mul_kernel(x_ptr, out_ptr, N, stride_xn, stride_on, inter,
                         BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
        # Program (row block, column block) of the output; up is the same columns of gate_up shifted by I.
        o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        m = (o_n < N)[:, None] & (o_i < inter)[None, :]
        p_x = x_ptr + o_n[:, None] * stride_xn + o_i[None, :]
        b_gate = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
        b_up = tl.load(p_x + inter, mask=m, other=0.0).to(tl.float32)
        # silu as PyTorch writes it, x / (1 + exp(-x)): -0 for very negative x, whose exp(-x) is inf.
        # Rounded to the input dtype before the product, as F.silu's output is.
        b_silu = tl.div_rn(b_gate, 1.0 + tl.exp(-b_gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + o_n[:, None] * stride_on + o_i[None, :], (b_silu * b_up).to(out_ptr.dtype.element_ty),
                 mask=m)
