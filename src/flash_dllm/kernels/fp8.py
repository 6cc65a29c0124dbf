"""FP8 (E4M3) activations and GEMMs: per-row dynamic quantisation, the FP8 product through cuBLAS, and the residual
add that dequantises it (Triton), beside their PyTorch references.

A quantised row x is values * scale with scale = amax(|x|) / 448 (E4M3's largest finite value); weights are
quantised the same way, one scale per output channel. So x @ w.T = (values_x @ values_w.T) * scale_x[:, None] *
scale_w[None, :], and the GEMM runs with unit scales (cuBLAS's per-tensor FP8 GEMM: on the H200 at LLaDA-8B's
shapes 1.07-1.8x faster than its row-wise-scaled one, which at 144 rows was slower than bf16). The kernel that reads
the product applies the two scales and the bias: RoPE's (rope_cache_write), SiLU's (silu_mul_fp8), the residual's
(here and rms_norm_fp8).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references work without triton; only the kernels need it
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 1 / FP8_MAX
MIN_AMAX = 1e-12  # an all-zero row gets a tiny positive scale, and its values quantise to 0


class Fp8Rows(NamedTuple):
    """Rows quantised to E4M3: values [M, K] float8_e4m3fn, scale [M] fp32; the rows are values * scale."""
    values: torch.Tensor
    scale: torch.Tensor


class ScaledProduct(NamedTuple):
    """An FP8 GEMM's result before its scales: the rows x @ w.T + bias are
    (values * row_scale[:, None]) * col_scale[None, :] + bias, computed by whoever reads them.
    values [M, N] in the model's dtype, row_scale [M] and col_scale [N] fp32, bias [N] in the model's dtype or None."""
    values: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor
    bias: torch.Tensor | None

    def rows(self, rows: slice) -> ScaledProduct:
        return ScaledProduct(self.values[rows], self.row_scale[rows], self.col_scale, self.bias)


def quantize_rows_ref(x: torch.Tensor) -> Fp8Rows:
    """x [..., K] -> values [..., K] E4M3 and scale [...] fp32, scale = max(amax(|row|), MIN_AMAX) * (1 / 448) (a
    product, not a quotient: PyTorch divides a CUDA tensor by a scalar as a product by its reciprocal, so only the
    product is the same on every device and in the kernels; the row's largest value may then land a hair beyond 448,
    which the clamp takes back)."""
    x32 = x.float()
    scale = x32.abs().amax(-1).clamp(min=MIN_AMAX) * INV_FP8_MAX
    return Fp8Rows((x32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale)


def dequantize_ref(product: ScaledProduct, dtype: torch.dtype) -> torch.Tensor:
    """The rows of a ScaledProduct in `dtype`: scaled and offset in fp32, rounded once."""
    out = product.values.float() * product.row_scale[:, None] * product.col_scale[None, :]
    return (out if product.bias is None else out + product.bias.float()).to(dtype)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_product(x: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> ScaledProduct:
    """x (Fp8Rows [M, K]) times weight [N, K] E4M3 with weight_scale [N] and bias [N] -> its ScaledProduct, the
    unscaled values in `dtype` (fp32 accumulation)."""
    one = _unit_scale(x.values.device)
    return ScaledProduct(torch._scaled_mm(x.values, weight.t(), one, one, out_dtype=dtype), x.scale, weight_scale,
                         bias)


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """The Triton kernel of quantize_rows_ref for x [M, K] (one launch; the row is read twice, the second time from
    L2). Graph capturable: no host syncs."""
    if triton is None:
        raise RuntimeError("quantize_rows needs triton; use quantize_rows_ref")
    M, K = x.shape
    assert x.stride(-1) == 1
    values = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](x, values, scale, x.stride(0), values.stride(0), K,
                                    BLOCK_K=min(4096, triton.next_power_of_2(K)), num_warps=4)
    return Fp8Rows(values, scale)


def add_dequantized_ref(x: torch.Tensor, product: ScaledProduct) -> torch.Tensor:
    """x [M, N] + the rows of product, as PyTorch adds two tensors of x's dtype (the product rounded first)."""
    return x + dequantize_ref(product, x.dtype)


def add_dequantized(x: torch.Tensor, product: ScaledProduct) -> torch.Tensor:
    """The Triton kernel of add_dequantized_ref (one launch)."""
    if triton is None:
        raise RuntimeError("add_dequantized needs triton; use add_dequantized_ref")
    M, N = x.shape
    values, bias = product.values, product.bias
    assert values.shape == (M, N) and x.stride(-1) == values.stride(-1) == 1
    out = torch.empty_like(x)
    if M:
        block_n = min(1024, triton.next_power_of_2(N))
        _add_dequantized_kernel[(M, triton.cdiv(N, block_n))](
            x, values, product.row_scale, product.col_scale, bias if bias is not None else x, out, x.stride(0),
            values.stride(0), out.stride(0), N, HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=4,
            enable_fp_fusion=False)  # (v * r) * c + b rounded after each operation, as the reference
    return out


if triton is not None:
    @triton.jit
    def dequantized(p_values, p_col, p_bias, row_scale, o_n, m_n, HAS_BIAS: tl.constexpr):
        """Columns o_n of a ScaledProduct's row in fp32: (values * row_scale) * col_scale (+ bias), each operation
        rounded as in dequantize_ref (launch with enable_fp_fusion=False), not yet rounded to the model's dtype."""
        b_out = tl.load(p_values + o_n, mask=m_n, other=0.0).to(tl.float32) * row_scale
        b_out = b_out * tl.load(p_col + o_n, mask=m_n, other=0.0)
        if HAS_BIAS:
            b_out += tl.load(p_bias + o_n, mask=m_n, other=0.0).to(tl.float32)
        return b_out

    # the globals a kernel reads must be constexpr
    _FP8_MAX, _INV_FP8_MAX, _MIN_AMAX = tl.constexpr(FP8_MAX), tl.constexpr(INV_FP8_MAX), tl.constexpr(MIN_AMAX)
    _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # read when the kernels are defined

    @triton.jit
    def scale_of(amax):
        """A row's scale from the amax of its values (fp32), as quantize_rows_ref's."""
        return tl.maximum(amax, _MIN_AMAX) * _INV_FP8_MAX

    @triton.jit
    def quantized(b_x, scale):
        """fp32 values divided by their row's scale (broadcast to b_x), clamped, rounded to E4M3 in fp32: exactly
        quantize_rows_ref's values, and the cast that stores them is exact."""
        return e4m3_round(tl.clamp(tl.div_rn(b_x, scale), -_FP8_MAX, _FP8_MAX))

    @triton.jit
    def e4m3_round(x):
        """fp32 x within +-448 -> the nearest E4M3 value, ties to even, in fp32, for the cast that stores it. On the
        GPU the cast rounds so itself (x unchanged). Interpreted: |x| over the E4M3 step of its binade (2^(exponent -
        3), the subnormals' 2^-9 at least; an exact division) rounded to an integer by adding and subtracting
        1.5 * 2^23, times the step; then x's sign (-0.0 included); the interpreter's own cast does not carry a
        rounded-up mantissa into the exponent (Triton 3.9: 124.1 -> 64)."""
        if not _INTERPRETED:
            return x
        bits = x.to(tl.int32, bitcast=True)
        step = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True), 0.015625) * 0.125
        rounded = ((tl.div_rn(tl.abs(x), step) + 12582912.0) - 12582912.0) * step
        return tl.where(bits < 0, -rounded, rounded)

    @triton.jit(do_not_specialize=["M"])
    def _quantize_rows_kernel(x_ptr, values_ptr, scale_ptr, stride_xm, stride_vm, K, BLOCK_K: tl.constexpr):
        # One program: one row, in column blocks: its amax, then its values.
        row = tl.program_id(0).to(tl.int64)
        p_x = x_ptr + row * stride_xm
        b_amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            o_k = start + tl.arange(0, BLOCK_K)
            b_amax = tl.maximum(b_amax, tl.abs(tl.load(p_x + o_k, mask=o_k < K, other=0.0).to(tl.float32)))
        scale = scale_of(tl.max(b_amax, 0))
        for start in range(0, K, BLOCK_K):
            o_k = start + tl.arange(0, BLOCK_K)
            b_x = tl.load(p_x + o_k, mask=o_k < K, other=0.0).to(tl.float32)
            tl.store(values_ptr + row * stride_vm + o_k, quantized(b_x, scale).to(values_ptr.dtype.element_ty),
                     mask=o_k < K)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _add_dequantized_kernel(x_ptr, values_ptr, row_ptr, col_ptr, bias_ptr, out_ptr, stride_xm, stride_vm,
                                stride_om, N, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        b_delta = dequantized(values_ptr + row * stride_vm, col_ptr, bias_ptr, tl.load(row_ptr + row), o_n, m_n,
                              HAS_BIAS).to(x_ptr.dtype.element_ty).to(tl.float32)
        b_x = tl.load(x_ptr + row * stride_xm + o_n, mask=m_n, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + o_n, (b_x + b_delta).to(out_ptr.dtype.element_ty), mask=m_n)
