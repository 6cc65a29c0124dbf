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
    """The Triton kernel of silu_mul_fp8_ref (same argument, same result), in two launches over (row, column block)
    programs: the products in the model's dtype (the reference's rounding) with each block's amax, then those
    quantised by their row's scale. One program a row looping over its columns was latency-bound, and computing
    the products twice compute-bound (H200, LLaDA-8B's 12,288 columns: 20 and 9.8 us at 144 rows, 207 and 187 at
    4,646, against 7.0 and 141)."""
    if triton is None:
        raise RuntimeError("silu_mul_fp8 needs triton; use silu_mul_fp8_ref")
    values, bias = gate_up.values, gate_up.bias
    M, inter = values.shape[0], values.shape[1] // 2
    assert values.shape[1] == 2 * inter and values.stride(-1) == 1
    out = Fp8Rows(torch.empty(M, inter, dtype=FP8, device=values.device),
                  torch.empty(M, dtype=torch.float32, device=values.device))
    if M:
        block_i = min(1024, triton.next_power_of_2(inter))
        blocks = triton.cdiv(inter, block_i)
        products = torch.empty(M, inter, dtype=values.dtype, device=values.device)
        block_amax = torch.empty(M, blocks, dtype=torch.float32, device=values.device)
        warps = max(1, min(4, block_i // 256))
        _silu_mul_amax_kernel[(M, blocks)](
            values, gate_up.row_scale, gate_up.col_scale, bias if bias is not None else values, products, block_amax,
            values.stride(0), inter, blocks, HAS_BIAS=bias is not None, BLOCK_I=block_i, num_warps=warps,
            enable_fp_fusion=False)  # each step rounded as in the reference
        _quantize_blocks_kernel[(M, blocks)](products, block_amax, out.values, out.scale, inter, blocks,
                                             BLOCK_I=block_i, BLOCK_BLOCKS=triton.next_power_of_2(blocks),
                                             num_warps=warps)
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
    def _silu_mul_amax_kernel(values_ptr, row_ptr, col_ptr, bias_ptr, products_ptr, amax_ptr, stride_vm, inter,
                              blocks, HAS_BIAS: tl.constexpr, BLOCK_I: tl.constexpr):
        row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
        o_i = block * BLOCK_I + tl.arange(0, BLOCK_I)
        b_out = _silu_mul_of(values_ptr + row * stride_vm, col_ptr, bias_ptr, tl.load(row_ptr + row), o_i,
                             o_i < inter, inter, HAS_BIAS)
        tl.store(products_ptr + row * inter + o_i, b_out.to(products_ptr.dtype.element_ty), mask=o_i < inter)
        tl.store(amax_ptr + row * blocks + block, tl.max(tl.abs(b_out), 0))

    @triton.jit
    def _quantize_blocks_kernel(products_ptr, amax_ptr, out_ptr, scale_ptr, inter, blocks, BLOCK_I: tl.constexpr,
                                BLOCK_BLOCKS: tl.constexpr):
        row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
        o_b = tl.arange(0, BLOCK_BLOCKS)
        scale = scale_of(tl.max(tl.load(amax_ptr + row * blocks + o_b, mask=o_b < blocks, other=0.0), 0))
        o_i = block * BLOCK_I + tl.arange(0, BLOCK_I)
        b_out = tl.load(products_ptr + row * inter + o_i, mask=o_i < inter, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * inter + o_i, quantized(b_out, scale).to(out_ptr.dtype.element_ty), mask=o_i < inter)
        if block == 0:
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
