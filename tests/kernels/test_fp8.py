"""FP8 activations: per-row quantisation against a float64 reference, and the kernels that quantise (the norm, SiLU,
the attention output's pass) or dequantise (the residual add) against their PyTorch references."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.kernels.fp8 import (FP8, FP8_MAX, Fp8Rows, ScaledProduct, add_dequantized, add_dequantized_ref,
                                    dequantize_ref, fp8_product, quantize_rows, quantize_rows_ref)
from flash_dllm.kernels.rms_norm import rms_norm_fp8, rms_norm_fp8_ref
from flash_dllm.kernels.silu_mul import silu_mul_fp8, silu_mul_fp8_ref

DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu's tails, interpreted


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)


def dequantized(rows: Fp8Rows) -> torch.Tensor:
    return rows.values.double() * rows.scale.double()[:, None]


def assert_same_rows(got: Fp8Rows, want: Fp8Rows, dtype: torch.dtype):
    """Scales within the dtype's budget and values within one E4M3 step. Interpreted, a bf16 kernel's roundings
    truncate (SiLU's three of them can lower a row's amax by 3 bf16 steps), so there the scales get 3%."""
    assert got.values.dtype == FP8 and got.scale.dtype == torch.float32
    interpreted_bf16 = dtype == torch.bfloat16 and DEVICE == "cpu"
    assert rel_err(got.scale, want.scale) < (0.03 if interpreted_bf16 else BUDGET[dtype])
    assert rel_err(dequantized(got), dequantized(want)) < (BUDGET[dtype] if dtype == torch.float32 else 0.07)
    if dtype == torch.float32:
        assert (got.values.view(torch.uint8) == want.values.view(torch.uint8)).float().mean() > 0.99


def product_of(rows: int, cols: int, dtype, bias: bool, seed=0) -> ScaledProduct:
    return ScaledProduct(randn(rows, cols, dtype=dtype, seed=seed, scale=30.0),
                         randn(rows, seed=seed + 1).abs() + 0.01, randn(cols, seed=seed + 2).abs() * 1e-3 + 1e-4,
                         randn(cols, dtype=dtype, seed=seed + 3) if bias else None)


def test_quantize_rows_ref_against_float64():
    """Each value within half an E4M3 step of the row (relative 2^-4 for normals, 2^-10 of the scale for
    subnormals); the row's largest magnitude maps to 448; an all-zero row stays zero."""
    x = randn(6, 300, scale=5.0)
    x[1] *= 1e-4
    x[2] = 0.0
    rows = quantize_rows_ref(x)
    exact = x.double()
    error = (dequantized(rows) - exact).abs()
    bound = torch.maximum(exact.abs() * 2 ** -4, rows.scale.double()[:, None] * 2 ** -10)
    assert (error <= bound * 1.0001).all()
    assert torch.equal(rows.values[[0, 1, 3]].float().abs().amax(-1), torch.full((3,), FP8_MAX, device=DEVICE))
    assert (rows.values[2].float() == 0).all() and rows.scale[2] > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 100), (3, 5000)], ids=lambda s: "m{}-k{}".format(*s))
def test_quantize_rows_matches_reference(shape, dtype):
    x = randn(shape[0], shape[1] + 8, dtype=dtype, scale=3.0)[:, :shape[1]]  # a row stride beyond K
    assert_same_rows(quantize_rows(x), quantize_rows_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_add_dequantized_matches_reference(dtype, bias):
    x, product = randn(7, 1100, dtype=dtype, seed=5), product_of(7, 1100, dtype, bias)
    out = add_dequantized(x, product)
    assert out.dtype == dtype and rel_err(out, add_dequantized_ref(x, product)) < BUDGET[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("norm_bias", [False, True])
def test_rms_norm_fp8_matches_reference(dtype, residual, norm_bias):
    rows, d = 9, 96
    x = randn(rows, d, dtype=dtype, seed=1)
    weight = randn(d, dtype=dtype, seed=2) + 1.0
    bias = randn(d, dtype=dtype, seed=3) if norm_bias else None
    delta = product_of(rows, d, dtype, bias=True) if residual else None
    summed, normed = rms_norm_fp8(x, weight, bias, 1e-5, delta)
    want_summed, want_normed = rms_norm_fp8_ref(x, weight, bias, 1e-5, delta)
    assert rel_err(summed, want_summed) < BUDGET[dtype]
    assert_same_rows(normed, want_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 40), (3, 2500)], ids=lambda s: "m{}-i{}".format(*s))
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_fp8_matches_reference(shape, dtype, bias):
    gate_up = product_of(shape[0], 2 * shape[1], dtype, bias, seed=7)
    assert_same_rows(silu_mul_fp8(gate_up), silu_mul_fp8_ref(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_product_is_the_scaled_gemm(dtype):
    """fp8_product then dequantize_ref = the float64 GEMM of the dequantised operands (fp32 accumulation)."""
    x, w = quantize_rows_ref(randn(5, 64, dtype=dtype)), quantize_rows_ref(randn(48, 64, dtype=dtype, seed=1))
    bias = randn(48, dtype=dtype, seed=2)
    out = dequantize_ref(fp8_product(x, w.values, w.scale, bias, dtype), dtype)
    want = dequantized(x) @ dequantized(w).T + bias.double()
    # Hopper's FP8 tensor cores accumulate with fewer than fp32's bits (7e-5 here on the H200)
    budget = 2e-4 if dtype == torch.float32 and DEVICE == "cuda" else BUDGET[dtype]
    assert out.dtype == dtype and rel_err(out, want) < budget


def test_no_rows():
    empty = randn(0, 32)
    assert quantize_rows(empty).values.shape == (0, 32)
    assert add_dequantized(empty, product_of(0, 32, torch.float32, False)).shape == (0, 32)
    assert silu_mul_fp8(product_of(0, 32, torch.float32, False)).values.shape == (0, 16)
