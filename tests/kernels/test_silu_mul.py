"""SiLU(gate) * up against its PyTorch reference (the MLP activation of LLaDABlock)."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.kernels.silu_mul import silu_mul, silu_mul_ref

# (rows, intermediate size): masked tails; several row tiles; several column blocks with a partial last one.
SHAPES = [(7, 40), (70, 100), (3, 2500)]
# The interpreter's numpy exp warns on exp(200) = inf, which the kernel relies on (silu(-200) = -0).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")


def make_gate_up(rows, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows of a wider buffer (row stride != 2 I); gates of both signs far into the tails of silu.
    gate_up = (3.0 * torch.randn(rows, 2 * inter + 8, generator=g))[:, :2 * inter]
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])
    return gate_up.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-i{}".format(*s))
def test_silu_mul_matches_reference(shape, dtype):
    gate_up = make_gate_up(*shape, dtype)
    out = silu_mul(gate_up)
    assert out.shape == shape and out.dtype == dtype
    assert rel_err(out, silu_mul_ref(gate_up)) < BUDGET[dtype]


def test_rounding_order():
    """Nearly every element bit-identical: silu is rounded to the input dtype before the product (rounding
    the fp32 product once instead leaves about 70% identical). fp16: the interpreter truncates fp32 -> bf16
    instead of rounding to nearest, so bf16 can't show this on the CPU."""
    gate_up = make_gate_up(5, 100, torch.float16)
    assert (silu_mul(gate_up) == silu_mul_ref(gate_up)).float().mean().item() > 0.99


def test_no_rows():
    assert silu_mul(make_gate_up(3, 40, torch.float32)[:0]).shape == (0, 40)
