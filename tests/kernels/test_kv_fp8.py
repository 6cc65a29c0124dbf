"""The FP8 (E4M3) KV cache's quantisation (kernels/kv_fp8.py): the reference against float64, and the kernels'
helpers against the reference, byte for byte."""
from kernel_testing import DEVICE, e4m3_steps  # first: it picks the interpreter on the CPU

import pytest
import torch
import triton
import triton.language as tl

from flash_dllm.kernels.fp8 import FP8, FP8_MAX as E4M3_MAX, e4m3_round, quantized, scale_of
from flash_dllm.kernels.fp8 import quantize_rows_ref
from flash_dllm.kernels.kv_fp8 import dequantize_kv


def heads(dtype, rows=40, kv_heads=3, head_dim=24, seed=0):
    """Random heads whose magnitudes span 2^-12..2^12, a head of zeros and a head of one non-zero value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, kv_heads, head_dim, generator=g) * 2.0 ** torch.randint(-12, 13, (rows, kv_heads, 1),
                                                                                  generator=g)
    x[0, 0] = 0.0
    x[1, 0] = 0.0
    x[1, 0, 5] = -3.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_half_an_e4m3_step(dtype):
    x = heads(dtype)
    values, scale = quantize_rows_ref(x)
    assert values.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    assert (scale > 0).all()
    exact = x.double()
    amax = exact.abs().amax(dim=-1)
    # amax / scale is 448 up to the rounding of the scale: the largest value of each non-zero head is +-448
    assert torch.equal(values.float().abs().amax(dim=-1)[amax > 0], torch.full_like(amax[amax > 0], E4M3_MAX))
    assert (values[0, 0].float() == 0).all() and values[1, 0].float().count_nonzero() == 1
    error = (dequantize_kv(values, scale, torch.float64) - exact).abs()
    # a normal E4M3 value's step is 2^-3 of its binade (2^-4 of it at most half a step away); subnormals': 2^-9
    bound = 2.0 ** -4 * exact.abs() + 2.0 ** -10 * scale.double()[..., None]
    assert (error <= bound * (1 + 1e-6)).all()
    assert dequantize_kv(values, scale, dtype).dtype == dtype


@triton.jit
def _quantize_kernel(x_ptr, values_ptr, scale_ptr, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    o_m, o_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    m = (o_d < D)[None, :]
    b_x = tl.load(x_ptr + o_m[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_scale = scale_of(tl.max(tl.abs(b_x), 1))
    tl.store(values_ptr + o_m[:, None] * D + o_d[None, :],
             quantized(b_x, b_scale[:, None]).to(values_ptr.dtype.element_ty),
             mask=m)
    tl.store(scale_ptr + o_m, b_scale)


@triton.jit
def _round_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(out_ptr + o, e4m3_round(tl.load(x_ptr + o, mask=o < N)).to(out_ptr.dtype.element_ty), mask=o < N)


def test_kernel_rounding_is_pytorchs_cast():
    """Every E4M3 value, the midpoints between neighbours (ties to even) and the fp32 values either side of them,
    subnormals, -0 and random values: the kernels' rounding writes the bytes of PyTorch's cast."""
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    every = every[~every.isnan()].sort().values
    middle = (every[1:] + every[:-1]) / 2
    x = torch.cat([every, middle, middle.nextafter(torch.tensor(1e9)), middle.nextafter(torch.tensor(-1e9)),
                   torch.tensor([-0.0, 1e-30, -1e-30, 447.99, -E4M3_MAX]),
                   torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 40]).clamp(-E4M3_MAX, E4M3_MAX)
    out = torch.empty(x.shape, dtype=FP8, device=DEVICE)
    _round_kernel[(1,)](x.to(DEVICE), out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(out.view(torch.uint8).cpu(), x.to(FP8).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantisation_is_the_references(dtype):
    x = heads(dtype, rows=16, kv_heads=1, head_dim=24)[:, 0]
    values, scale = torch.empty(x.shape, dtype=FP8, device=DEVICE), torch.empty(16, device=DEVICE)
    _quantize_kernel[(1,)](x, values, scale, 24, BLOCK_M=16, BLOCK_D=32)
    ref_values, ref_scale = quantize_rows_ref(x)
    assert torch.equal(scale, ref_scale) and e4m3_steps(values, ref_values) == 0
