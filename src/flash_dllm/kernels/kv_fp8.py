"""FP8 (E4M3) K and V in the KV cache (`KVCache(kv_dtype=torch.float8_e4m3fn)`): the PyTorch reference of their
quantisation, beside the Triton helpers that the cache writers share.

Each (cache row, KV head) holds its head_dim values in E4M3 and one fp32 scale, scale = max(amax, MIN_AMAX) / 448
of the head's values (448: E4M3's largest finite value; MIN_AMAX: an all-zero head gets a positive scale and stores
zeros); a value is stored as x / scale (correctly rounded), clamped to +-448 and rounded to the nearest E4M3, ties
to even. A reader dequantises a value as its E4M3 value times its scale. K is quantised after RoPE, from the value
a cache in the model's dtype would hold: an fp8 cache holds quantize_kv of that cache's rows.

The kernels round to E4M3 in fp32 arithmetic (`e4m3_round`), so that the cast that follows is exact: the bytes of
PyTorch's cast on the GPU and under the Triton interpreter, whose own fp32 -> E4M3 cast does not carry a rounded-up
mantissa into the exponent (Triton 3.9: 124.1 -> 64).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernels need it
    triton = None

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_AMAX = 1e-12


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> values [..., D] E4M3 and scale [...] fp32: each row of D values (a KV head's) with its own
    scale."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1).clamp(min=MIN_AMAX) / E4M3_MAX
    return (x32 / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] E4M3, scale [...] fp32 -> values * scale [..., D], computed in fp32 and rounded once to dtype."""
    return (values.float() * scale[..., None]).to(dtype)


class ScaleArguments(NamedTuple):
    """A kernel's arguments for the scales of two K or V tensors: whether they are fp8 (its KV_FP8), the two scale
    tensors (or dummies, unread) and their row strides."""
    on: bool
    pointers: tuple
    strides: tuple


def scale_arguments(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> ScaleArguments:
    """For k, v [rows, Hkv, D] and their scales [rows, Hkv] fp32 (both None: k and v in the model's dtype)."""
    if k_scale is None and v_scale is None:
        assert k.dtype != FP8 and v.dtype != FP8, "fp8 K and V need their scales"
        return ScaleArguments(False, (k, k), (0, 0))
    assert k.dtype == v.dtype == FP8 and k_scale.dtype == v_scale.dtype == torch.float32
    assert k_scale.shape == k.shape[:2] and v_scale.shape == v.shape[:2]
    assert k_scale.stride(-1) == v_scale.stride(-1) == 1
    return ScaleArguments(True, (k_scale, v_scale), (k_scale.stride(0), v_scale.stride(0)))


if triton is not None:
    # the globals a kernel reads must be constexpr
    _E4M3_MAX, _MIN_AMAX = tl.constexpr(E4M3_MAX), tl.constexpr(MIN_AMAX)

    @triton.jit
    def kv_scale(amax):
        """A head's scale from the amax of its values (fp32), as quantize_kv's."""
        return tl.div_rn(tl.maximum(amax, _MIN_AMAX), _E4M3_MAX)

    @triton.jit
    def quantized(b_x, b_scale):
        """fp32 values b_x [M, D] of M heads with their scales b_scale [M] -> their E4M3 values, in fp32 (exactly
        quantize_kv's: the cast to E4M3 that stores them is exact)."""
        return e4m3_round(tl.clamp(tl.div_rn(b_x, b_scale[:, None]), -_E4M3_MAX, _E4M3_MAX))

    @triton.jit
    def e4m3_round(x):
        """fp32 x within +-448 -> the nearest E4M3 value, ties to even, in fp32: |x| over the E4M3 step of its binade
        (2^(exponent - 3), the subnormals' 2^-9 at least; an exact division) rounded to an integer by adding and
        subtracting 1.5 * 2^23, times the step; then x's sign (-0.0 included)."""
        bits = x.to(tl.int32, bitcast=True)
        step = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True), 0.015625) * 0.125
        rounded = ((tl.div_rn(tl.abs(x), step) + 12582912.0) - 12582912.0) * step
        return tl.where(bits < 0, -rounded, rounded)
