"""LLaDA in plain PyTorch: OLMo-style Llama blocks with bidirectional attention and an untied LM head.

Module names follow the checkpoint (`model.transformer.blocks.{i}.attn_out.weight`, ...) except that
q/k/v and gate/up are packed into one matrix each, so that each is a single matmul;
`checkpoint_layout` says which rows of which parameter every checkpoint tensor fills.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.block_table import BlockTable
from ..cache.kv_cache import KVCache
from ..config import ModelConfig
from ..kernels.attention import ragged_attention_ref
from ..kernels.flash_attention import flash_attention
from ..kernels.fused_qkv_rope import qkv_rope
from ..kernels.rms_norm import rms_norm, rms_norm_ref
from ..kernels.silu_mul import silu_mul, silu_mul_ref


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor, kernel: bool = False) -> torch.Tensor:
        """`kernel`: the Triton kernel (one launch) instead of its PyTorch reference (LLaDA's math)."""
        return (rms_norm if kernel else rms_norm_ref)(x, self.weight, self.bias, self.eps)


class PackedLinear(nn.Linear):
    """A linear layer whose output rows are several checkpoint matrices stacked (q|k|v or gate|up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, L] -> cos, sin [B, L, head_dim] in fp32 (rotate-half layout)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


class Rotary(NamedTuple):
    """The RoPE of a pass's flat rows: positions [N] for the fused kernel, cos/sin [N, D] for the reference."""
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def at(cls, positions: torch.Tensor, cfg: ModelConfig) -> Rotary:
        return cls(positions, *rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta))

    def __getitem__(self, rows):  # the same rows of all three
        return Rotary(*(t[rows] for t in tuple(self)))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D]; cos, sin [..., D]. Rotation in fp32, result in x's dtype."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)


class LLaDABlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        self.qkv_proj = PackedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.qkv_bias)
        self.attn_out = nn.Linear(q_size, cfg.hidden_size, bias=cfg.linear_bias)
        self.ff_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        self.gate_up_proj = PackedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.linear_bias)
        self.ff_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.linear_bias)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn_mask: torch.Tensor | None) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = apply_rotary(q.view(B, L, self.num_heads, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rotary(k.view(B, L, self.num_kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = v.view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.num_kv_heads != self.num_heads:  # GQA: kv head j serves query heads j*g .. j*g+g-1
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # bidirectional
        return self.attn_out(out.transpose(1, 2).reshape(B, L, -1))

    def cached_attention(self, x: torch.Tensor, rope: Rotary, table: BlockTable, cache: KVCache,
                         key_mass: torch.Tensor | None, kernels: bool) -> torch.Tensor:
        """x [N, d] flat query rows: write their K/V to the cache (unless the table says not to) and attend
        over each request's cache range. `kernels`: the Triton kernels instead of their PyTorch references."""
        if kernels:
            return self.attn_out(self._kernel_attention(x, rope, table, cache, key_mass).flatten(1))
        N = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = apply_rotary(q.view(N, self.num_heads, self.head_dim), rope.cos, rope.sin)
        k = apply_rotary(k.view(N, self.num_kv_heads, self.head_dim), rope.cos, rope.sin)
        v = v.view(N, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        if table.write_cache:
            k_cache[table.slot_mapping], v_cache[table.slot_mapping] = k, v
            out = ragged_attention_ref(q, k_cache, v_cache, table, key_mass)
        else:
            out = ragged_attention_ref(q, k_cache, v_cache, table, key_mass, k_new=k, v_new=v)
        return self.attn_out(out.reshape(N, -1))

    def _kernel_attention(self, x, rope, table, cache, key_mass) -> torch.Tensor:
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        project = lambda slots, k_out, v_out: qkv_rope(
            x, self.qkv_proj.weight, self.qkv_proj.bias, rope.positions, slots, k_out, v_out, self.num_heads,
            self.rope_theta)
        if table.write_cache:
            q = project(table.slot_mapping, k_cache, v_cache)
            return flash_attention(q, k_cache, v_cache, table, key_mass)
        # A pass that must not write the cache (verify): its own K/V go to fresh rows.
        k_new, v_new = (x.new_empty(x.shape[0], self.num_kv_heads, self.head_dim) for _ in range(2))
        q = project(torch.arange(x.shape[0], device=x.device), k_new, v_new)
        return flash_attention(q, k_cache, v_cache, table, key_mass, k_new=k_new, v_new=v_new)

    def mlp(self, x: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(self.ff_norm(x, kernels))
        return self.ff_out((silu_mul if kernels else silu_mul_ref)(gate_up))

    def forward(self, x, cos, sin, attn_mask):
        x = x + self.attention(self.attn_norm(x), cos, sin, attn_mask)
        return x + self.mlp(x)

    def forward_cached(self, x, rope, table, cache, key_mass, kernels: bool = False):
        """`kernels`: the norms, attention and MLP activation through the Triton kernels."""
        x = x + self.cached_attention(self.attn_norm(x, kernels), rope, table, cache, key_mass, kernels)
        return x + self.mlp(x, kernels)


class LLaDAModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            "blocks": nn.ModuleList(LLaDABlock(cfg, layer) for layer in range(cfg.num_layers)),
            "ln_f": RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias),
        })
        if not cfg.tie_word_embeddings:
            self.transformer["ff_out"] = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.linear_bias)
        self.use_kernels = False  # cached passes through the Triton kernels (LLM turns this on for CUDA)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] -> final-normed hidden states [B, L, d].

        positions [B, L] are the RoPE positions (default 0..L-1); attention_mask [B, L] is True for the
        keys a row may attend to (False for padding).
        """
        B, L = input_ids.shape
        if positions is None:
            positions = torch.arange(L, device=input_ids.device).expand(B, L)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        attn_mask = None if attention_mask is None else attention_mask[:, None, None, :]
        x = self.transformer["wte"](input_ids)
        for block in self.transformer["blocks"]:
            x = block(x, cos, sin, attn_mask)
        return self.transformer["ln_f"](x)

    def forward_cached(self, input_ids: torch.Tensor, positions: torch.Tensor, table: BlockTable, cache: KVCache,
                       key_mass: torch.Tensor | None = None) -> torch.Tensor:
        """Flat query rows input_ids, positions [N] -> final-normed hidden states [N, d].

        Each layer writes the rows' K/V into `cache` at table.slot_mapping, then every request's rows
        attend to its whole range of the cache (see BlockTable). With key_mass [B, max_kv], the attention
        mass of the tracked rows is accumulated over layers and heads.
        """
        rope = Rotary.at(positions, self.config)
        x = self.transformer["wte"](input_ids)
        for block in self.transformer["blocks"]:
            x = block.forward_cached(x, rope, table, cache, key_mass, self.use_kernels)
        return self.transformer["ln_f"](x, self.use_kernels)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., V]; called only on the rows whose logits are used."""
        head = self.transformer["wte"] if self.config.tie_word_embeddings else self.transformer["ff_out"]
        return F.linear(hidden, head.weight, getattr(head, "bias", None))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] -> logits [B, L, V] under full bidirectional attention."""
        return self.compute_logits(self.hidden_states(input_ids, positions, attention_mask))

    def checkpoint_layout(self) -> dict[str, tuple[str, slice | None]]:
        """Checkpoint tensor name -> (parameter name, rows of that parameter it fills, or None for all)."""
        layout: dict[str, tuple[str, slice | None]] = {}
        packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("ff_proj", "up_proj")}
        for param_name, _ in self.named_parameters():
            module_name, _, kind = param_name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            if leaf in packed:
                module = self.get_submodule(module_name)
                for shard, ckpt_leaf in enumerate(packed[leaf]):
                    layout[f"model.{parent}.{ckpt_leaf}.{kind}"] = (param_name, module.rows(shard))
            else:
                layout[f"model.{param_name}"] = (param_name, None)
        return layout
