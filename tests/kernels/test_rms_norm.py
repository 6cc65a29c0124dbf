"""RMSNorm against its PyTorch reference, and the model's RMSNorm through the kernel."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.kernels.rms_norm import rms_norm, rms_norm_ref
from flash_dllm.models.layers import RMSNorm

EPS = 1e-5
# (rows, d): masked tails of rows and of d, the second over several row tiles; LLaDA-8B's d_model (a row a
# program).
SHAPES = [(7, 40), (70, 100), (2, 4096)]


def make_inputs(rows, d, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows of a wider buffer (row stride != d); row 0 all zeros (rsqrt(eps), not NaN), row 1 large.
    x = torch.randn(rows, d + 8, generator=g)[:, :d]
    x[0] = 0.0
    x[1] *= 100.0
    weight = 1.0 + 0.3 * torch.randn(d, generator=g)
    b = torch.randn(d, generator=g) if bias else None
    return [None if t is None else t.to(DEVICE, dtype) for t in (x, weight, b)]


def bit_match(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-d{}".format(*s))
def test_rms_norm_matches_reference(shape, bias, dtype):
    x, weight, b = make_inputs(*shape, bias, dtype)
    out = rms_norm(x, weight, b, EPS)
    assert out.shape == shape and out.dtype == dtype
    assert rel_err(out, rms_norm_ref(x, weight, b, EPS)) < BUDGET[dtype]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_rounding_order(bias):
    """Nearly every element bit-identical: the normalised row is rounded to x's dtype before the scale, and
    the product before the bias (rounding the fp32 result once instead leaves about 70% identical). fp16:
    the interpreter truncates fp32 -> bf16 instead of rounding to nearest, so bf16 can't show this on the CPU."""
    x, weight, b = make_inputs(5, 100, bias, torch.float16)
    assert bit_match(rms_norm(x, weight, b, EPS), rms_norm_ref(x, weight, b, EPS)) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_norm_through_the_kernel(dtype):
    norm = RMSNorm(100, EPS, bias=True).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3), norm.bias.normal_()
    x = make_inputs(6, 100, False, dtype)[0]
    assert rel_err(norm(x, kernels=True), norm(x)) < BUDGET[dtype]


def test_no_rows():
    x, weight, b = make_inputs(3, 40, True, torch.float32)
    assert rms_norm(x[:0], weight, b, EPS).shape == (0, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_rows_are_the_same_in_any_batch(dtype):
    """One row a program (batch-invariant decoding): a row normed alone equals the row in a batch of 70."""
    x, weight, b = make_inputs(70, 100, True, dtype)
    batched = rms_norm(x, weight, b, EPS, invariant=True)
    assert rel_err(batched, rms_norm_ref(x, weight, b, EPS)) < BUDGET[dtype]
    for rows in (slice(5, 6), slice(0, 9)):
        assert torch.equal(rms_norm(x[rows], weight, b, EPS, invariant=True), batched[rows])
