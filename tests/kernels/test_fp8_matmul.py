"""The FP8 GEMM for a few rows against the float64 product of its E4M3 operands, and its dispatch against cuBLAS's."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.kernels.fp8 import dequantize_ref, fp8_product, quantize_rows_ref
from flash_dllm.kernels.fp8_matmul import TRITON_MAX_ROWS, fp8_gemm, fp8_matmul


def operands(rows: int, out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = quantize_rows_ref(torch.randn(rows, in_features + 16, generator=g)[:, :in_features].to(DEVICE))
    w = quantize_rows_ref(torch.randn(out_features, in_features, generator=g).to(DEVICE))
    return x, w


# masked tails in every dimension; several token tiles (100 rows); several weight-row blocks
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 48, 64), (5, 100, 200), (100, 96, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_matches_float64(rows, out_features, in_features, dtype):
    x, w = operands(rows, out_features, in_features)
    out = fp8_gemm(x.values, w.values, dtype)
    want = x.values.double() @ w.values.double().T
    budget = 2e-4 if dtype == torch.float32 and DEVICE == "cuda" else BUDGET[dtype]  # Hopper's FP8 accumulation
    assert out.shape == (rows, out_features) and out.dtype == dtype and rel_err(out, want) < budget


@pytest.mark.parametrize("rows", [3, TRITON_MAX_ROWS + 1])  # this file's kernel, then cuBLAS's
def test_fp8_matmul_gives_fp8_products_result(rows):
    x, w = operands(rows, 64, 96, seed=1)
    bias = torch.randn(64, device=DEVICE)
    got = dequantize_ref(fp8_matmul(x, w.values, w.scale, bias, torch.float32), torch.float32)
    want = dequantize_ref(fp8_product(x, w.values, w.scale, bias, torch.float32), torch.float32)
    assert rel_err(got, want) < (2e-4 if DEVICE == "cuda" else BUDGET[torch.float32])
