"""The layers every architecture is built from: RMSNorm, packed linear projections, rotary embeddings,
attention (full, under the mask of the model's pattern; or cached, bidirectional over the flat KV cache, through
the Triton kernels or their PyTorch references), the gated MLP, and the pre-norm decoder layer that joins them
with its feed-forward block.

Module names are generic (`attention.qkv_proj`, `mlp.down_proj`, ...); each architecture maps them to
its checkpoint's tensor names (`DiffusionLM.checkpoint_names`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.attention_metadata import AttentionMetadata
from ..cache.kv_cache import KVCache, store_kv
from ..config import ModelConfig
from ..cache.routing import CHUNK, count_in_full, route, update_kmeans
from ..kernels.attention import ordered_attention_in_chunks, ragged_attention_ref
from ..kernels.chunk_summaries import write_chunk_summaries
from ..kernels.flash_attention import flash_attention
from ..kernels.fp8 import Fp8Rows, ScaledProduct, add_dequantized, dequantize_ref, quantize_rows
from ..kernels.fused_qkv_rope import qkv_rope
from ..kernels.invariant_matmul import invariant_matmul
from ..kernels.rope_cache_write import rope_cache_write
from ..kernels.route_chunks import route_chunks
from ..kernels.rms_norm import rms_norm, rms_norm_fp8, rms_norm_ref
from ..kernels.silu_mul import silu_mul, silu_mul_fp8, silu_mul_ref
from .parallel import TensorParallel
from .quantization import Fp8Linear, stacked_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor, kernels: bool = False, invariant: bool = False) -> torch.Tensor:
        """`kernels`: the Triton kernel (one launch) instead of its PyTorch reference (normed in fp32);
        `invariant`: with one row per program (batch-invariant decoding)."""
        if kernels:
            return rms_norm(x, self.weight, self.bias, self.eps, invariant)
        return rms_norm_ref(x, self.weight, self.bias, self.eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
    """F.linear, or with `invariant` the batch-invariant GEMM (a row's result the same in any batch)."""
    if not invariant:
        return F.linear(x, weight, bias)
    out = invariant_matmul(x, weight)
    return out if bias is None else out + bias


def project(module: nn.Linear | Fp8Linear, x: torch.Tensor, invariant: bool, rows: slice | None = None,
            bias: bool = True) -> torch.Tensor:
    """module(x), or its output rows `rows` only (without its bias if not `bias`); invariant: through the
    batch-invariant GEMM (not for FP8 weights, which the runner refuses with batch_invariant)."""
    if isinstance(module, Fp8Linear):
        return module(x, rows, bias)
    rows = rows or slice(None)
    return linear(x, module.weight[rows], None if module.bias is None or not bias else module.bias[rows], invariant)


def row_parallel(module: nn.Linear | Fp8Linear, x: torch.Tensor, invariant: bool, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel projection (o_proj, down_proj): each rank's product over its share of the input features x,
    summed over the ranks (one all-reduce), the bias added once."""
    if tp.size == 1:
        return project(module, x, invariant)
    out = tp.all_reduce(project(module, x, invariant, bias=False))
    return out if module.bias is None else out + module.bias


def row_parallel_product(module: Fp8Linear, x: Fp8Rows, tp: TensorParallel) -> ScaledProduct:
    """row_parallel on the kernel path with FP8 weights: the ranks' products dequantised and summed in the model's
    dtype, as a ScaledProduct of unit scales carrying the bias (the kernel that reads it adds it)."""
    if tp.size == 1:
        return module.product(x)
    summed = tp.all_reduce(dequantize_ref(module.product(x, bias=False), module.dtype))
    rows, columns = summed.shape
    return ScaledProduct(summed, torch.ones(rows, device=summed.device), torch.ones(columns, device=summed.device),
                         module.bias)


class PackedLinear(nn.Linear):
    """A linear layer whose output rows are several checkpoint matrices stacked (q|k|v or gate|up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def rows(self, shard: int) -> slice:
        return stacked_rows(self.output_sizes, shard)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., head_dim] in fp32 (rotate-half layout)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


class Rotary(NamedTuple):
    """The RoPE of a pass's rows: positions for the fused kernel, cos/sin [..., D] for the reference."""
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def at(cls, positions: torch.Tensor, cfg: ModelConfig) -> Rotary:
        return cls(positions, *rotary_cos_sin(positions, cfg.rotary_width, cfg.rope_theta))

    def __getitem__(self, rows):  # the same rows of all three
        return Rotary(*(t[rows] for t in tuple(self)))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D]; cos, sin [..., R] with R <= D: the first R entries of each head rotated (rotate-half layout),
    the others passed through. Rotation in fp32, result in x's dtype."""
    width = cos.shape[-1]
    x32 = x[..., :width].float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (x32 * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)
    return out if width == x.shape[-1] else torch.cat([out, x[..., width:]], dim=-1)


class Attention(nn.Module):
    """Attention with grouped K/V heads (GQA) from one packed q|k|v projection. Under tensor
    parallelism `cfg` is the rank's shard (parallel.shard_config: its heads) and the output projection is summed over
    the ranks."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel):
        super().__init__()
        self.layer = layer  # its K/V buffers in the cache
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.linear_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, bias=False)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, bias=False)
        self.qk_norm = cfg.qk_norm
        # The fused QKV + RoPE + cache-write kernels rotate whole heads of the raw projection; a model that norms q
        # and k first, or rotates part of each head, runs its GEMM, then the norms and RoPE, then the cache write.
        self.fused_rope = not cfg.qk_norm and cfg.rotary_width == cfg.head_dim

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: bool = False):
        """The packed projection's output qkv [..., q|k|v] -> the rotated q [..., H, D], k [..., Hkv, D] and v:
        each query and key head RMS-normed first where the model says so."""
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q, kernels), self.k_norm(k, kernels)
        return (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin),
                v.unflatten(-1, (self.num_kv_heads, self.head_dim)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None, ordered: bool = False, kernels: bool = False) -> torch.Tensor:
        """x [B, L, d] -> [B, L, d]; attn_mask [B, 1, 1 or L, L] True for the keys a row may see (None: all).
        ordered: every sum over keys in one fixed order (batch-invariant decoding); with `kernels`, through the
        Triton kernels (the invariant GEMM, and the flash attention kernel over each row's own keys)."""
        B, L, _ = x.shape
        invariant = ordered and kernels
        q, k, v = self.heads(project(self.qkv_proj, x, invariant), cos, sin, invariant)
        if invariant:
            out = self._kernel_full_attention(q, k, v, attn_mask)
            return row_parallel(self.o_proj, out.reshape(B, L, -1), invariant, self.tp)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.num_kv_heads != self.num_heads:  # GQA: kv head j serves query heads j*g .. j*g+g-1
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if ordered:
            visible = torch.ones(B, 1, 1, L, dtype=torch.bool, device=x.device) if attn_mask is None else attn_mask
            out = ordered_attention_in_chunks(q, k, v, visible)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return row_parallel(self.o_proj, out.transpose(1, 2).reshape(B, L, -1), False, self.tp)

    def _kernel_full_attention(self, q, k, v, attn_mask) -> torch.Tensor:
        """q [B, L, H, D], k, v [B, L, Hkv, D] -> [B, L, H, D]: each row over its own row's keys as attn_mask
        allows, through the flash attention kernel (a pass of B requests with no cache keys, every key a pass
        row), in one tiling: the same sums whatever the batch, for rows whose tokens come first."""
        B, L = q.shape[:2]
        device = q.device
        visible = (torch.ones(B, L, L, dtype=torch.bool, device=device) if attn_mask is None
                   else attn_mask[:, 0].expand(B, L, L))
        flat = lambda t: t.reshape(B * L, *t.shape[2:])
        no_keys = torch.zeros(B, dtype=torch.long, device=device)
        metadata = AttentionMetadata(cu_seqlens_q=torch.arange(B + 1, device=device) * L, kv_start=no_keys,
                                     kv_len=no_keys, slot_mapping=torch.arange(B * L, device=device), max_q=L,
                                     max_kv=0, write_cache=False, self_visibility=visible, ordered=True)
        k, v = flat(k), flat(v)
        return flash_attention(flat(q), k, v, metadata, k_new=k, v_new=v).view(B, L, *q.shape[2:])

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """The rotated queries [..., H, D] of normed hidden states x [..., d] (no cache access)."""
        q = project(self.qkv_proj, x, invariant, self.qkv_proj.rows(0)).unflatten(-1, (self.num_heads, self.head_dim))
        return apply_rotary(self.q_norm(q, invariant, invariant) if self.qk_norm else q, cos, sin)

    def forward_cached(self, x: torch.Tensor, rope: Rotary, metadata: AttentionMetadata, cache: KVCache,
                       key_mass: torch.Tensor | None, kernels: bool) -> torch.Tensor:
        """x [N, d] flat query rows: write their K/V to the cache (unless the metadata says not to) and attend
        over each request's cache range. `kernels`: the Triton kernels instead of their PyTorch references."""
        if kernels:
            out = self._kernel_attention(x, rope, metadata, cache, key_mass).flatten(1)
            return row_parallel(self.o_proj, out, metadata.ordered, self.tp)
        N = x.shape[0]
        q, k, v = self.heads(self.qkv_proj(x), rope.cos, rope.sin)
        if metadata.write_cache:
            cache.write(self.layer, metadata.slot_mapping, k, v)
        own = {} if metadata.write_cache else dict(k_new=k, v_new=v)
        out = ragged_attention_ref(q, cache.k[self.layer], cache.v[self.layer], metadata, key_mass,
                                   **self._routed(q, cache, metadata, False), **own, **cache.scales(self.layer))
        return row_parallel(self.o_proj, out.reshape(N, -1), False, self.tp)

    def _routed(self, q: torch.Tensor, cache: KVCache, metadata: AttentionMetadata, kernels: bool) -> dict:
        """The attention's routing argument: the cache keys each request's KV head reads this pass, where its
        prompt keys are routed. `kernels`: from the chunk summaries kept beside the cache, first rewritten where
        the pass wrote prompt keys (and the k-means regions kept beside it), in a few launches; else the
        reference's, from the cache."""
        if metadata.routing is None:
            return {}
        scales = cache.scales(self.layer)
        if kernels:
            summaries = cache.chunk_summaries(CHUNK)[self.layer]
            if metadata.write_cache:
                written = metadata.routing.written_chunks(metadata, cache.scratch_row)
                write_chunk_summaries(cache.k[self.layer], summaries, *written, scales.get("k_scale"))
        kmeans = None
        if "kmeans" in metadata.routing.policies:
            kmeans = tuple(part[self.layer] for part in cache.kmeans_regions(CHUNK))
            if metadata.write_cache:
                update_kmeans(cache.k[self.layer], cache.v[self.layer], *kmeans, metadata, **scales)
        if metadata.routing.read_in_full:  # a full pass: the dense attention
            count_in_full(metadata, self.num_kv_heads)
            return {}
        if kernels:
            return dict(routed=route_chunks(q, summaries, metadata, self.layer, kmeans))
        return dict(key_visible=route(q, cache.k[self.layer], metadata, self.layer, kmeans, scales.get("k_scale")))

    def forward_cached_fp8(self, x: Fp8Rows, rope: Rotary, metadata: AttentionMetadata, cache: KVCache,
                           key_mass: torch.Tensor | None) -> ScaledProduct:
        """The kernel path with FP8 weights: x [N, d] normed rows already quantised -> the output projection's
        ScaledProduct (the residual add dequantises it)."""
        out = self._kernel_attention(x, rope, metadata, cache, key_mass).flatten(1)
        return row_parallel_product(self.o_proj, quantize_rows(out), self.tp)

    def _kernel_attention(self, x: torch.Tensor | Fp8Rows, rope, metadata, cache, key_mass) -> torch.Tensor:
        """The QKV projection, RoPE and cache write, then the flash attention. With an FP8 cache (cache.scales) the
        writers quantise K and V and the attention reads them with their scales."""
        k_cache, v_cache, scales = cache.k[self.layer], cache.v[self.layer], cache.scales(self.layer)
        if not self.fused_rope:  # the GEMM, the norms and RoPE, then the cache write
            qkv = (dequantize_ref(self.qkv_proj.product(x), self.qkv_proj.dtype) if isinstance(x, Fp8Rows)
                   else project(self.qkv_proj, x, metadata.ordered))

            def write_qkv(slots, k_out, v_out, **out_scales):
                q, k, v = self.heads(qkv, rope.cos, rope.sin, kernels=True)
                store_kv(k_out, v_out, slots, k, v, **out_scales)
                return q
        elif isinstance(x, Fp8Rows):  # the FP8 GEMM, then RoPE and the cache write scaling its product
            qkv = self.qkv_proj.product(x)

            def write_qkv(slots, k_out, v_out, **out_scales):
                return rope_cache_write(qkv.values, rope.positions, slots, k_out, v_out, self.num_heads,
                                        self.rope_theta, dequant=(qkv.row_scale, qkv.col_scale), bias=qkv.bias,
                                        **out_scales)
        else:
            def write_qkv(slots, k_out, v_out, **out_scales):
                return qkv_rope(x, self.qkv_proj.weight, self.qkv_proj.bias, rope.positions, slots, k_out, v_out,
                                self.num_heads, self.rope_theta, invariant=metadata.ordered, **out_scales)
        if metadata.write_cache:
            q = write_qkv(metadata.slot_mapping, k_cache, v_cache, **scales)
            return flash_attention(q, k_cache, v_cache, metadata, key_mass, **self._routed(q, cache, metadata, True),
                                   **scales)
        # A pass that must not write the cache (verify): its own K/V go to fresh rows, in the model's dtype.
        N = rope.positions.shape[0]
        k_new, v_new = (torch.empty(N, self.num_kv_heads, self.head_dim, dtype=cache.dtype, device=k_cache.device)
                        for _ in range(2))
        q = write_qkv(torch.arange(N, device=k_cache.device), k_new, v_new)
        return flash_attention(q, k_cache, v_cache, metadata, key_mass, k_new=k_new, v_new=v_new,
                               **self._routed(q, cache, metadata, True), **scales)


# A pass over more rows runs its MLP in row chunks: the [rows, 2 x intermediate] activation is a long pass's largest
# buffer (LLaDA-8B's first pass at batch 32 x 768 rows: 1.2 GB, with 0.6 GB more for its SiLU product). Not under
# autograd, which keeps every chunk's activations anyway (training/train_llada2.py).
MLP_CHUNK_ROWS = 8192


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up packed into one projection."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, intermediate_size: int | None = None):
        """intermediate_size: the rank's width (default cfg.intermediate_size; a shared expert's is its own)."""
        super().__init__()
        self.tp = tp
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = PackedLinear(cfg.hidden_size, [inter] * 2, bias=cfg.linear_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.linear_bias)

    def forward(self, x: torch.Tensor, kernels: bool = False, invariant: bool = False) -> torch.Tensor:
        """`invariant`: the batch-invariant GEMMs (with the kernels on)."""
        return row_parallel(self.down_proj, self._gated(x, kernels, invariant), invariant, self.tp)

    def partial(self, x: torch.Tensor, kernels: bool = False, invariant: bool = False) -> torch.Tensor:
        """forward's rank's product before the sum over the ranks, its bias on rank 0 only: a caller that sums other
        partial products (models/moe.py: the experts') adds it to theirs, for one all-reduce."""
        return project(self.down_proj, self._gated(x, kernels, invariant), invariant, bias=self.tp.rank == 0)

    def _gated(self, x: torch.Tensor, kernels: bool, invariant: bool) -> torch.Tensor:
        return (silu_mul if kernels else silu_mul_ref)(project(self.gate_up_proj, x, invariant))

    def forward_fp8(self, x: Fp8Rows) -> ScaledProduct:
        """The kernel path with FP8 weights: normed rows already quantised -> the down projection's ScaledProduct."""
        return row_parallel_product(self.down_proj, silu_mul_fp8(self.gate_up_proj.product(x)), self.tp)


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)), `mlp` the layer's feed-forward block
    (DiffusionLM.feed_forward)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, mlp: nn.Module):
        super().__init__()
        self.tp = tp
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        self.attention = Attention(cfg, layer, tp)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        self.mlp = mlp

    def forward(self, x, cos, sin, attn_mask, ordered: bool = False, kernels: bool = False):
        """ordered: batch-invariant sums; with `kernels` (the only way on the GPU) through the Triton kernels."""
        invariant = ordered and kernels
        x = x + self.attention(self.attn_norm(x, invariant, invariant), cos, sin, attn_mask, ordered, kernels)
        return self._mlp_residual(x, invariant, invariant)

    def forward_cached(self, x: torch.Tensor, rope: Rotary, metadata: AttentionMetadata, cache: KVCache,
                       key_mass: torch.Tensor | None, kernels: bool = False) -> torch.Tensor:
        """`kernels`: the norms, attention and MLP activation through the Triton kernels (and with
        metadata.ordered, the batch-invariant GEMMs). Under tensor parallelism a rank's attention gives its own
        heads' mass: key_mass gets the sum over the ranks' (one all-reduce)."""
        if key_mass is None or self.tp.size == 1:
            return self._forward_cached(x, rope, metadata, cache, key_mass, kernels)
        mass = torch.zeros_like(key_mass)
        x = self._forward_cached(x, rope, metadata, cache, mass, kernels)
        key_mass += self.tp.all_reduce(mass)
        return x

    def _forward_cached(self, x, rope, metadata, cache, key_mass, kernels) -> torch.Tensor:
        if kernels and isinstance(self.attention.o_proj, Fp8Linear):  # quantize_linears: every projection FP8
            return self._forward_cached_fp8(x, rope, metadata, cache, key_mass)
        invariant = metadata.ordered and kernels
        x = x + self.attention.forward_cached(self.attn_norm(x, kernels, invariant), rope, metadata, cache, key_mass,
                                              kernels)
        return self._mlp_residual(x, kernels, invariant)

    def _forward_cached_fp8(self, x, rope, metadata, cache, key_mass) -> torch.Tensor:
        """The kernel path with FP8 weights: each GEMM's input quantised by the kernel that writes it (the norms,
        SiLU, a quantising pass over the attention's output) and its output scaled by the kernel that reads it (RoPE,
        SiLU, the residual adds, the first fused with the MLP's norm). The feed-forward block gives `forward_fp8`."""
        norm = lambda module, rows, residual=None: rms_norm_fp8(rows, module.weight, module.bias, module.eps, residual)
        attended = self.attention.forward_cached_fp8(norm(self.attn_norm, x)[1], rope, metadata, cache, key_mass)
        if not hasattr(self.mlp, "forward_fp8"):  # experts (models/moe.py) read the normed rows in the model's dtype
            return self._mlp_residual(add_dequantized(x, attended), True, False)
        parts = []
        for start in range(0, x.shape[0], MLP_CHUNK_ROWS):  # as _mlp_residual
            rows = slice(start, start + MLP_CHUNK_ROWS)
            summed, normed = norm(self.mlp_norm, x[rows], attended.rows(rows))
            parts.append(add_dequantized(summed, self.mlp.forward_fp8(normed)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _mlp_residual(self, x: torch.Tensor, kernels: bool, invariant: bool) -> torch.Tensor:
        """x + mlp(norm(x)) over [..., d], at most MLP_CHUNK_ROWS rows at a time (a row's MLP reads no other row;
        its GEMMs' rounding could still follow the row count, which the embedded tasks' tokens on the H200 did not
        show)."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MLP_CHUNK_ROWS or torch.is_grad_enabled():
            return x + self.mlp(self.mlp_norm(x, kernels, invariant), kernels, invariant)
        out = torch.empty_like(rows)
        for start in range(0, rows.shape[0], MLP_CHUNK_ROWS):
            part = rows[start:start + MLP_CHUNK_ROWS]
            out[start:start + MLP_CHUNK_ROWS] = part + self.mlp(self.mlp_norm(part, kernels, invariant), kernels,
                                                                invariant)
        return out.view_as(x)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """The rotated queries [..., H, D] this layer computes from its input hidden states x [..., d]."""
        return self.attention.queries(self.attn_norm(x, invariant, invariant), cos, sin, invariant)
