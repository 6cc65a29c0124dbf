"""The FP8 GEMM for a few rows (Triton), beside cuBLAS's (kernels/fp8.py `fp8_product`, its reference).

At a decoding step's few dozen rows a GEMM only streams its weights, and cuBLAS's FP8 kernels stream them at a
fifth of the HBM rate (H200, LLaDA-8B's QKV at 32 rows: 57 us against an 11.8 us weight-read floor; bf16 took 52).
Here the weights take the MMA's wide side: a program multiplies BLOCK_W weight rows by BLOCK_T rows of x (the MMA's
narrow side, which can be as small as 16; a few such tiles at most, whose programs read the same weights at the same
time, from L2 after the first), so the weights are read from HBM once, by enough programs to occupy every SM. The output is the same unscaled product as cuBLAS's (fp32 accumulation, rounded once).
"""
from __future__ import annotations

import os

import torch

from .fp8 import Fp8Rows, ScaledProduct, fp8_product

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None

# Rows up to which the kernel beats cuBLAS's FP8 GEMM (H200, LLaDA-8B's projections: benchmarks/fp8_gemm_configs.py).
TRITON_MAX_ROWS = 256


def fp8_matmul(x: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> ScaledProduct:
    """fp8_product by the faster kernel for this many rows: this file's for at most TRITON_MAX_ROWS on the GPU (or
    interpreted), else cuBLAS's."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is None or x.values.shape[0] > TRITON_MAX_ROWS or not (x.values.is_cuda or interpreted):
        return fp8_product(x, weight, weight_scale, bias, dtype)
    return ScaledProduct(fp8_gemm(x.values, weight, dtype), x.scale, weight_scale, bias)


def launch_config(num_rows: int, out_features: int) -> dict:
    """Tile sizes by row count and output width, from a sweep on the H200 at LLaDA-8B's shapes
    (benchmarks/fp8_gemm_configs.py): enough weight-row blocks to occupy 132 SMs."""
    block_t = min(64, max(16, triton.next_power_of_2(num_rows)))
    block_w = 64 if out_features >= 8192 else 32
    return dict(BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_K=128, num_warps=4, num_stages=4)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """x [M, K] E4M3 @ weight [N, K] E4M3 -> [M, N] in `dtype` (fp32 accumulation). Graph capturable.
    config: the launch's tile sizes (default: launch_config)."""
    if triton is None:
        raise RuntimeError("fp8_gemm needs triton; use fp8_product")
    (M, K), N = x.shape, weight.shape[0]
    assert weight.shape[1] == K and x.stride(-1) == weight.stride(-1) == 1
    out = torch.empty(M, N, dtype=dtype, device=x.device)
    if M == 0:
        return out
    config = config or launch_config(M, N)
    _fp8_gemm_kernel[(triton.cdiv(N, config["BLOCK_W"]), triton.cdiv(M, config["BLOCK_T"]))](
        x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        DOT_FP32=x.device.type == "cpu", **config)
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["M"])  # the row count varies by step: no recompilation per M % 16
    def _fp8_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, DOT_FP32: tl.constexpr,
                         BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program: BLOCK_W weight rows (output columns) against BLOCK_T rows of x; acc is out's tile transposed.
        o_w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
        o_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        m_w, m_t = o_w < N, o_t < M
        acc = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            o_k = start + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_w = tl.load(w_ptr + o_w[:, None].to(tl.int64) * stride_wn + o_k[None, :],
                          mask=m_w[:, None] & m_k[None, :], other=0.0)
            b_x = tl.load(x_ptr + o_t[:, None] * stride_xm + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            if DOT_FP32:  # the interpreter's dot has no fp8 inputs; the products are exact in fp32 anyway
                acc += tl.dot(b_w.to(tl.float32), tl.trans(b_x.to(tl.float32)), input_precision="ieee")
            else:
                acc = tl.dot(b_w, tl.trans(b_x), acc)
        tl.store(out_ptr + o_t[None, :] * stride_om + o_w[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=m_w[:, None] & m_t[None, :])
