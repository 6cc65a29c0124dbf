"""`flash-dllm bench kernels`: each Triton kernel against the PyTorch path it replaces and against the vendor
kernel for the same math (cuBLAS's GEMM, torch SDPA), at a model's dimensions, with its error against the
PyTorch reference. Inputs are random; the projection uses the model's first QKV weight.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata, cu_seqlens
from ..config import ModelConfig
from ..kernels.attention import ragged_attention_ref
from ..kernels.flash_attention import flash_attention
from ..kernels.fused_qkv_rope import fused_qkv_rope, fused_qkv_rope_ref, qkv_rope
from ..kernels.rms_norm import rms_norm, rms_norm_ref
from ..kernels.silu_mul import silu_mul, silu_mul_ref
from ..markdown import markdown_table
from .forward import time_ms


@dataclass(frozen=True)
class KernelResult:
    kernel: str
    shape: str
    ms: float
    reference_ms: float  # the PyTorch path the kernel replaces
    vendor: str          # the vendor kernel for the same math, or "" if none
    vendor_ms: float
    rel_err: float       # against the PyTorch reference; inf if NaN


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if out.isnan().any() else ((out - ref).norm() / ref.norm()).item()


def attention_inputs(cfg: ModelConfig, batch: int, rows: int, kv_length: int, dtype, device):
    """Random q [batch * rows, H, D] and a cache holding `batch` ranges of kv_length rows, with the block
    metadata of `rows` queries per request attending to its range (half the rows tracked)."""
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)
    q = rand(batch * rows, cfg.num_heads, cfg.head_dim)
    k_cache, v_cache = (rand(batch * kv_length, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
    metadata = AttentionMetadata(cu_seqlens_q=cu_seqlens([rows] * batch, device),
                                 kv_start=torch.arange(batch, device=device) * kv_length,
                                 kv_len=torch.full((batch,), kv_length, device=device),
                                 slot_mapping=torch.zeros(batch * rows, dtype=torch.long, device=device),  # unused
                                 max_q=rows, max_kv=kv_length, track_rows=torch.rand(batch * rows, device=device) < 0.5)
    return q, k_cache, v_cache, metadata


@torch.inference_mode()
def bench_kernels(model, batch: int, rows: int, kv_length: int, warmup: int = 10, iters: int = 50,
                  seed: int = 0) -> list[KernelResult]:
    """`rows` query rows per request, the tail of a sequence of kv_length positions, for `batch` requests."""
    torch.manual_seed(seed)
    cfg = model.config
    layer = model.layers[0]
    weight, bias = layer.attention.qkv_proj.weight, layer.attention.qkv_proj.bias
    device, dtype = weight.device, weight.dtype
    N, shape = batch * rows, f"B={batch} rows={rows} kv={kv_length}"
    time = lambda fn: time_ms(fn, warmup, iters, device)
    results = []

    def add(name, kernel, reference, vendor="", vendor_fn=None, compare=None):
        err = rel_err(*(compare() if compare else (kernel(), reference())))
        results.append(KernelResult(name, shape, time(kernel), time(reference), vendor,
                                    time(vendor_fn) if vendor_fn else float("nan"), err))

    x = torch.randn(N, cfg.hidden_size, device=device, dtype=dtype)
    positions = (torch.arange(rows, device=device) + kv_length - rows).repeat(batch)
    slots = torch.arange(batch, device=device).repeat_interleave(rows) * kv_length + positions
    caches = [torch.zeros(batch * kv_length, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype)
              for _ in range(4)]
    project = lambda fn, k, v: fn(x, weight, bias, positions, slots, k, v, cfg.num_heads, cfg.rope_theta)
    reference = lambda: project(fused_qkv_rope_ref, caches[2], caches[3])

    def compare_projection(fn):  # q, and the K and V written to the cache, against the reference's
        outs = [project(fn, caches[0], caches[1]), caches[0][slots], caches[1][slots]]
        refs = [reference(), caches[2][slots], caches[3][slots]]
        return torch.cat([t.flatten() for t in outs]), torch.cat([t.flatten() for t in refs])

    gemm = lambda: F.linear(x, weight, bias)
    for name, fn in (("fused qkv+rope+cache write", fused_qkv_rope), ("qkv_rope (the model's path)", qkv_rope)):
        add(name, lambda fn=fn: project(fn, caches[0], caches[1]), reference, "cuBLAS GEMM alone", gemm,
            compare=lambda fn=fn: compare_projection(fn))

    q, k_cache, v_cache, metadata = attention_inputs(cfg, batch, rows, kv_length, dtype, device)
    group = cfg.num_heads // cfg.num_kv_heads
    dense = lambda t, length: t.view(batch, length, -1, cfg.head_dim).transpose(1, 2)
    k_dense, v_dense = (dense(c, kv_length).repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
    sdpa = lambda: F.scaled_dot_product_attention(dense(q, rows), k_dense, v_dense)
    add("attention", lambda: flash_attention(q, k_cache, v_cache, metadata),
        lambda: ragged_attention_ref(q, k_cache, v_cache, metadata), "SDPA dense", sdpa)
    masses = [torch.zeros(batch, kv_length, device=device) for _ in range(2)]
    with_mass = lambda fn, mass: lambda: fn(q, k_cache, v_cache, metadata, key_mass=mass.zero_())

    def compare_mass():
        with_mass(flash_attention, masses[0])()
        with_mass(ragged_attention_ref, masses[1])()
        return masses
    add("attention + key mass", with_mass(flash_attention, masses[0]), with_mass(ragged_attention_ref, masses[1]),
        "SDPA dense", sdpa, compare=compare_mass)
    verify_table = dataclasses.replace(metadata, write_cache=False,
                                       hidden_keys=torch.rand(batch, kv_length, device=device) < 0.1,
                                       self_visibility=torch.rand(batch, rows, rows, device=device) < 0.5)
    k_new, v_new = (torch.randn(N, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype) for _ in range(2))
    verify = lambda fn: lambda: fn(q, k_cache, v_cache, verify_table, k_new=k_new, v_new=v_new)
    add("verify pass", verify(flash_attention), verify(ragged_attention_ref), "SDPA dense", sdpa)

    norm = layer.attn_norm
    add("rms_norm", lambda: rms_norm(x, norm.weight, norm.bias, norm.eps),
        lambda: rms_norm_ref(x, norm.weight, norm.bias, norm.eps))
    gate_up = torch.randn(N, 2 * cfg.intermediate_size, device=device, dtype=dtype)
    add("silu_mul", lambda: silu_mul(gate_up), lambda: silu_mul_ref(gate_up))
    return results


def format_table(results: list[KernelResult]) -> str:
    header = ("kernel", "shape", "ms", "PyTorch path ms", "x faster than PyTorch", "vendor kernel", "vendor ms",
              "x faster than vendor", "rel err")
    rows = [(r.kernel, r.shape, f"{r.ms:.3f}", f"{r.reference_ms:.3f}", f"{r.reference_ms / r.ms:.2f}",
             r.vendor or "-", "-" if not r.vendor else f"{r.vendor_ms:.3f}",
             "-" if not r.vendor else f"{r.vendor_ms / r.ms:.2f}", f"{r.rel_err:.1e}") for r in results]
    return markdown_table(header, rows)
