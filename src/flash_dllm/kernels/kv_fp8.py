"""FP8 (E4M3) K and V in the KV cache (`KVCache(kv_dtype=torch.float8_e4m3fn)`): the PyTorch reference of their
dequantisation, and the kernels' scale arguments.

Each (cache row, KV head) holds its head_dim values in E4M3 and one fp32 scale, max(amax, MIN_AMAX) * (1 / 448)
of the head's values (448: E4M3's largest finite value; MIN_AMAX: an all-zero head gets a positive scale and stores
zeros); a value is stored as x / scale (correctly rounded), clamped to +-448 and rounded to the nearest E4M3, ties
to even. A reader dequantises a value as its E4M3 value times its scale. K is quantised after RoPE, from the value
a cache in the model's dtype would hold: an fp8 cache holds fp8.quantize_rows_ref of that cache's rows
(each KV head's D values a row).

The kernels quantise with kernels/fp8.py's helpers (`scale_of`, `quantized`), the same as the activations'.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .fp8 import FP8


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
