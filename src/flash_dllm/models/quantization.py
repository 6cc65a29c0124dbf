"""Quantisation options: `kv_cache_dtype="fp8"` (the KV cache in E4M3, cache/kv_cache.py) and weight quantisation
(`quantization="fp8"`): the decoder layers' linear projections with E4M3 weights, one scale per
output channel, quantised as the checkpoint's tensors are loaded (or drawn); their inputs are quantised per row
dynamically. The embeddings, the norms and the LM head keep the model's dtype.

On the kernel path the layers call `product` with rows that their producing kernels have already quantised
(kernels/fp8.py); `forward` is the PyTorch reference that quantises its input itself.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8 import FP8, Fp8Rows, ScaledProduct, dequantize_ref, fp8_product, quantize_rows_ref

QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = {"fp8": FP8}  # kv_cache_dtype -> the cache's K/V dtype (cache/kv_cache.py; else the model's)


def check_quantization(quantization: str | None) -> str | None:
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
    return quantization


def kv_dtype_of(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The KV cache's K/V dtype for kv_cache_dtype (None: the model's)."""
    if kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} or None, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES.get(kv_cache_dtype)


def check_options(quantization: str | None, kv_cache_dtype: str | None, batch_invariant: bool):
    """Each option's value, and their combination: the batch-invariant mode takes neither."""
    check_quantization(quantization)
    kv_dtype_of(kv_cache_dtype)
    if batch_invariant and quantization:
        raise ValueError(f"batch_invariant=True is not supported with quantization={quantization!r}: the FP8 GEMMs "
                         f"are cuBLAS's, whose sums follow the batch's shape")
    if batch_invariant and kv_cache_dtype:
        raise ValueError(f"batch_invariant=True is not supported with kv_cache_dtype={kv_cache_dtype!r}: the FP8 "
                         f"cache's attention kernels have no batch-invariant tiling")


def stacked_rows(output_sizes: list[int], shard: int) -> slice:
    """The output rows of checkpoint matrix `shard` of a packed projection whose matrices have output_sizes."""
    start = sum(output_sizes[:shard])
    return slice(start, start + output_sizes[shard])


class Fp8Linear(nn.Module):
    """y = x @ weight.T + bias with weight [out, in] E4M3 (the `weight` parameter, filled by `set_weight`) and
    weight_scale [out] fp32 (a buffer: not a checkpoint tensor); y and bias in `dtype`, the model's. output_sizes:
    the stacked checkpoint matrices of a packed projection (q|k|v, gate|up), as PackedLinear's."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.output_sizes = in_features, sum(output_sizes), output_sizes
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=FP8), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(self.out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(linear.in_features, getattr(linear, "output_sizes", [linear.out_features]), linear.bias is not None,
                   linear.weight.dtype)

    def rows(self, shard: int) -> slice:
        return stacked_rows(self.output_sizes, shard)

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor, rows: slice | None = None, columns: slice | None = None):
        """Quantise `weight` (any float dtype, on this module's device) into output rows `rows` (default: all);
        `columns`: only these columns of it are this module's (a row-parallel shard under tensor parallelism),
        each output channel's scale still that of its whole row, as without tensor parallelism."""
        rows = rows or slice(None)
        values, scale = quantize_rows_ref(weight)
        self.weight[rows] = values if columns is None else values[:, columns]
        self.weight_scale[rows] = scale

    def product(self, x: Fp8Rows, bias: bool = True) -> ScaledProduct:
        """The kernel path: quantised rows x [M, in] -> the ScaledProduct [M, out] (without the bias if not
        `bias`)."""
        return fp8_product(x, self.weight, self.weight_scale, self.bias if bias else None, self.dtype)

    def forward(self, x: torch.Tensor, rows: slice | None = None, bias: bool = True) -> torch.Tensor:
        """x [..., in] -> [..., out] (or output rows `rows` only; without the bias if not `bias`) in the model's
        dtype: the PyTorch reference (cuBLAS's FP8 GEMM on the GPU)."""
        rows = rows or slice(None)
        product = fp8_product(quantize_rows_ref(x.reshape(-1, self.in_features)), self.weight[rows],
                              self.weight_scale[rows], None if self.bias is None or not bias else self.bias[rows],
                              self.dtype)
        return dequantize_ref(product, self.dtype).view(*x.shape[:-1], -1)


def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of the model's decoder layers (not its LM head) by an Fp8Linear of the same shape, and
    hold stacked experts in FP8 (`quantize_experts`), on the model's device (meta before loading)."""
    for layer in model.layers:
        for name, module in list(layer.named_modules()):
            if hasattr(module, "quantize_experts"):
                module.quantize_experts()
            if isinstance(module, nn.Linear):
                parent, _, attribute = name.rpartition(".")
                with torch.device(module.weight.device):
                    setattr(layer.get_submodule(parent), attribute, Fp8Linear.like(module))
    return model
