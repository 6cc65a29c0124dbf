"""`flash-dllm bench kernels`: each Triton kernel against the PyTorch path it replaces and against the vendor
kernel for the same math (cuBLAS's GEMM, torch SDPA), at a model's dimensions, with its error against the
PyTorch reference. Inputs are random; the projection uses the model's first QKV weight. With FP8 weights: the
kernels that quantise and dequantise around the FP8 GEMMs, and each GEMM against cuBLAS's in the model's dtype and
against its weight-read floor. On a mixture-of-experts model: the router and the experts' grouped GEMMs against
their PyTorch references and against the read floor of the experts the rows touch.
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
from ..kernels.fp8 import Fp8Rows, add_dequantized, add_dequantized_ref, quantize_rows, quantize_rows_ref
from ..kernels.fused_qkv_rope import fused_qkv_rope, fused_qkv_rope_ref, qkv_rope
from ..kernels.moe_experts import moe_experts, moe_experts_fp8, moe_experts_fp8_ref, moe_experts_ref
from ..kernels.moe_router import route_kernel
from ..kernels.rms_norm import rms_norm, rms_norm_fp8, rms_norm_fp8_ref, rms_norm_ref
from ..kernels.silu_mul import silu_mul, silu_mul_fp8, silu_mul_fp8_ref, silu_mul_ref
from ..markdown import markdown_table
from .forward import graph_time_ms, time_ms
from .roofline import HBM_BYTES_PER_S


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
    for pack, name in ((True, "packed"), (False, "per query head")) if group > 1 else ():  # either launch (`packs`)
        add(f"attention, {name}", lambda pack=pack: flash_attention(q, k_cache, v_cache, metadata, pack_gqa=pack),
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


@torch.inference_mode()
def bench_fp8_kernels(model, rows: int, iters: int = 50, seed: int = 0) -> list[KernelResult]:
    """The kernels that quantise FP8 GEMMs' inputs and scale their outputs, against their PyTorch references, at
    `rows` rows of a model with quantization="fp8"; GPU times from CUDA graphs (graph_time_ms)."""
    torch.manual_seed(seed)
    cfg, layer = model.config, model.layers[0]
    device, dtype = layer.attn_norm.weight.device, layer.attn_norm.weight.dtype
    time = lambda fn: graph_time_ms(fn, device, iters=iters)
    shape = f"rows={rows}"
    x = torch.randn(rows, cfg.hidden_size, device=device, dtype=dtype)
    normed = quantize_rows_ref(x)
    o_out = layer.attention.o_proj.product(quantize_rows_ref(torch.randn(rows, cfg.num_heads * cfg.head_dim,
                                                                         device=device, dtype=dtype)))
    gate_up = layer.mlp.gate_up_proj.product(normed)
    norm = layer.mlp_norm
    cases = [
        ("quantize_rows (attention output)", lambda: quantize_rows(x), lambda: quantize_rows_ref(x)),
        ("rms_norm_fp8", lambda: rms_norm_fp8(x, norm.weight, norm.bias, norm.eps),
         lambda: rms_norm_fp8_ref(x, norm.weight, norm.bias, norm.eps)),
        ("rms_norm_fp8 + residual", lambda: rms_norm_fp8(x, norm.weight, norm.bias, norm.eps, o_out),
         lambda: rms_norm_fp8_ref(x, norm.weight, norm.bias, norm.eps, o_out)),
        ("silu_mul_fp8", lambda: silu_mul_fp8(gate_up), lambda: silu_mul_fp8_ref(gate_up)),
        ("add_dequantized", lambda: add_dequantized(x, o_out), lambda: add_dequantized_ref(x, o_out)),
    ]
    # compared: the quantised rows, dequantised (the normed ones of rms_norm_fp8's (sum, rows)), or the sum
    as_values = lambda out: out.values.float() * out.scale[:, None] if isinstance(out, Fp8Rows) else out
    compared = lambda out: as_values(out[-1] if isinstance(out, tuple) and not isinstance(out, Fp8Rows) else out)
    results = []
    for name, kernel, reference in cases:
        err = rel_err(compared(kernel()), compared(reference()))
        results.append(KernelResult(name, shape, time(kernel), time(reference), "", float("nan"), err))
    return results


@dataclass(frozen=True)
class GemmResult:
    projection: str
    rows: int
    bf16_ms: float        # cuBLAS, the model's dtype
    fp8_ms: float         # the engine's FP8 GEMM: cuBLAS with unit scales (the reading kernel applies them)
    fp8_rowwise_ms: float  # cuBLAS with row-wise scales, for comparison
    floor_ms: float       # the FP8 weight read alone at HBM_BYTES_PER_S


@torch.inference_mode()
def bench_fp8_gemms(model, row_counts: list[int], iters: int = 50) -> list[GemmResult]:
    """Each FP8 projection of the first layer at each row count against cuBLAS's GEMM on the same weights in the
    model's dtype, and against the weight-read floor; GPU times from CUDA graphs (graph_time_ms)."""
    layer = model.layers[0]
    device, dtype = layer.attn_norm.weight.device, layer.attn_norm.weight.dtype
    time = lambda fn: graph_time_ms(fn, device, iters=iters)  # GPU time without the launch, as in the engine's graphs
    results = []
    for rows in row_counts:
        for name, proj in (("qkv", layer.attention.qkv_proj), ("o", layer.attention.o_proj),
                           ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            x = quantize_rows_ref(torch.randn(rows, proj.in_features, device=device, dtype=dtype))
            weight = (proj.weight.float() * proj.weight_scale[:, None]).to(dtype)
            dense = x.values.to(dtype)
            row_scale, col_scale = x.scale[:, None].contiguous(), proj.weight_scale[None, :].contiguous()
            rowwise = lambda: torch._scaled_mm(x.values, proj.weight.t(), row_scale, col_scale, out_dtype=dtype)
            results.append(GemmResult(name, rows, time(lambda: F.linear(dense, weight)), time(lambda: proj.product(x)),
                                      time(rowwise), proj.weight.numel() / HBM_BYTES_PER_S * 1e3))
    return results


def format_gemm_table(results: list[GemmResult]) -> str:
    header = ("projection", "rows", "bf16 cuBLAS ms", "fp8 ms (unit scales)", "x faster than bf16",
              "fp8 row-wise cuBLAS ms", "fp8 weight-read floor ms", "x floor")
    rows = [(r.projection, r.rows, f"{r.bf16_ms:.4f}", f"{r.fp8_ms:.4f}", f"{r.bf16_ms / r.fp8_ms:.2f}",
             f"{r.fp8_rowwise_ms:.4f}", f"{r.floor_ms:.4f}", f"{r.fp8_ms / r.floor_ms:.2f}") for r in results]
    totals = {}
    for r in results:
        totals.setdefault(r.rows, [0.0, 0.0, 0.0, 0.0])
        for i, value in enumerate((r.bf16_ms, r.fp8_ms, r.fp8_rowwise_ms, r.floor_ms)):
            totals[r.rows][i] += value
    rows += [("layer", n, f"{b:.4f}", f"{f:.4f}", f"{b / f:.2f}", f"{w:.4f}", f"{fl:.4f}", f"{f / fl:.2f}")
             for n, (b, f, w, fl) in totals.items()]
    return markdown_table(header, rows)


@dataclass(frozen=True)
class MoEResult:
    rows: int
    experts_touched: int
    router_ms: float            # kernels/moe_router.py's launch
    router_reference_ms: float  # models.moe.route
    experts_ms: float           # the grouped GEMMs (kernels/moe_experts.py)
    experts_reference_ms: float  # an expert at a time
    floor_ms: float             # the touched experts' weights read once at HBM_BYTES_PER_S
    rel_err: float              # the experts' output against the reference's


@torch.inference_mode()
def bench_moe_kernels(model, row_counts: list[int], iters: int = 50, seed: int = 0) -> list[MoEResult]:
    """The first MoE layer's router and experts at each row count (random normed rows: about uniform routing); the
    kernels' GPU times from CUDA graphs (graph_time_ms), the references' wall times (they sync to find each expert's
    rows)."""
    from ..models.moe import SparseMoE, route

    torch.manual_seed(seed)
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE))
    device, dtype = moe.router_weight.device, model.embed.weight.dtype
    if moe.fp8_params:
        stacks = (Fp8Rows(moe.w_gate_up, moe.w_gate_up_scale), Fp8Rows(moe.w_down, moe.w_down_scale))
        kernel, reference = moe_experts_fp8, moe_experts_fp8_ref
        expert_bytes = sum(s.values[0].numel() * s.values.element_size() + s.scale[0].numel() * 4 for s in stacks)
    else:
        stacks, kernel, reference = (moe.w_gate_up, moe.w_down), moe_experts, moe_experts_ref
        expert_bytes = sum(s[0].numel() * s.element_size() for s in stacks)
    results = []
    for rows in row_counts:
        x = torch.randn(rows, model.config.hidden_size, device=device, dtype=dtype)
        logits = F.linear(x.float(), moe.router_weight.float())
        chosen, weights = route_kernel(logits, moe.cfg, moe.expert_bias)
        touched = chosen.unique().numel()
        run = lambda experts: experts(x, chosen, weights, *stacks)
        results.append(MoEResult(
            rows, touched, graph_time_ms(lambda: route_kernel(logits, moe.cfg, moe.expert_bias), device, iters=iters),
            time_ms(lambda: route(logits, moe.cfg, moe.expert_bias), 2, iters, device),
            graph_time_ms(lambda: run(kernel), device, iters=iters), time_ms(lambda: run(reference), 1, iters, device),
            touched * expert_bytes / HBM_BYTES_PER_S * 1e3, rel_err(run(kernel), run(reference))))
    return results


def format_moe_table(results: list[MoEResult]) -> str:
    header = ("rows", "experts touched", "router ms", "route() ms", "x faster", "experts ms", "an expert at a time ms",
              "x faster", "touched experts' read floor ms", "x floor", "rel err")
    rows = [(r.rows, r.experts_touched, f"{r.router_ms:.4f}", f"{r.router_reference_ms:.4f}",
             f"{r.router_reference_ms / r.router_ms:.2f}", f"{r.experts_ms:.4f}", f"{r.experts_reference_ms:.4f}",
             f"{r.experts_reference_ms / r.experts_ms:.2f}", f"{r.floor_ms:.4f}", f"{r.experts_ms / r.floor_ms:.2f}",
             f"{r.rel_err:.1e}") for r in results]
    return markdown_table(header, rows)
