"""The mixture-of-experts feed-forward block of LLaDA2.x and LLaDA-MoE: a router picks `experts_per_token` of
`num_experts` SwiGLU experts per token and weighs them; an optional shared expert is added unweighted.

The experts' weights are stacked ([E, 2 I, d] gate|up, [E, d, I] down) so that the kernel path runs each
projection over all experts as one grouped GEMM (kernels/moe_experts.py); the PyTorch reference gathers each
expert's tokens. The checkpoint keeps one tensor per expert and projection (`experts.{e}.gate_proj.weight`, ...),
which `checkpoint_placements` maps into the stacks. Under tensor parallelism every expert's intermediate dimension
is split over the ranks, like the gated MLP's, and the block's output summed over them; under expert parallelism
(TensorParallel.expert_parallel) each rank holds a contiguous share of whole experts instead, routes every token
(the router is replicated, as the rows are), runs only the pairs of the experts it holds, and the same one sum over
the ranks combines them. The shared expert is split as the gated MLP, and its partial sum joins the experts' in that
one all-reduce. With FP8 weights
(`quantize_experts`) each expert's output channels are E4M3 with an fp32 scale each, quantised as they load.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels.fp8 import FP8, Fp8Rows, quantize_rows_ref
from ..kernels.moe_experts import moe_experts, moe_experts_fp8, moe_experts_fp8_ref, moe_experts_ref
from ..kernels.moe_router import route_kernel
from .layers import GatedMLP
from .parallel import TensorParallel

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """A model whose feed-forward blocks are mixtures of experts after its first `dense_layers` (which keep the gated
    MLP of intermediate_size)."""

    num_experts: int = 1
    experts_per_token: int = 1
    expert_intermediate_size: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: int = 0
    # "softmax": the top-k of a softmax over all experts (LLaDA-MoE); "sigmoid": per-expert sigmoid scores, chosen
    # with expert_bias added, within the best groups (LLaDA2).
    router: str = "softmax"
    expert_groups: int = 1
    groups_kept: int = 1
    normalize_weights: bool = False  # the chosen experts' weights divided by their sum
    routed_scaling: float = 1.0
    expert_bias: bool = False

    split_widths = ("intermediate_size", "expert_intermediate_size", "shared_intermediate_size")
    expert_widths = ("expert_intermediate_size",)

    def __post_init__(self):
        super().__post_init__()
        if self.router not in ROUTERS:
            raise ValueError(f"config: router score function {self.router!r} is not supported (supported: "
                             f"{', '.join(ROUTERS)})")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"config: num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                             f"{self.experts_per_token}")
        if self.expert_intermediate_size <= 0:
            raise ValueError(f"config: the experts' intermediate size must be positive, got "
                             f"{self.expert_intermediate_size}")
        if self.num_experts % self.expert_groups or not 0 < self.groups_kept <= self.expert_groups:
            raise ValueError(f"config: {self.num_experts} experts in {self.expert_groups} groups keeping "
                             f"{self.groups_kept} is not a valid grouping")
        per_group = self.num_experts // self.expert_groups
        if self.groups_kept * per_group < self.experts_per_token or (self.expert_groups > 1 and per_group < 2):
            raise ValueError(f"config: {self.groups_kept} kept groups of {per_group} experts cannot hold "
                             f"{self.experts_per_token} chosen experts (and a group scores its best 2)")
        if not 0 <= self.dense_layers <= self.num_layers:
            raise ValueError(f"config: the dense first layers must be in [0, {self.num_layers}], got "
                             f"{self.dense_layers}")


def route(logits: torch.Tensor, cfg: MoEConfig, expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (fp32) -> the chosen experts [N, k] and their weights [N, k] (fp32). The kernel path
    runs kernels/moe_router.py's one launch instead."""
    k = cfg.experts_per_token
    if cfg.router == "softmax":
        weights, chosen = logits.softmax(dim=-1).topk(k, dim=-1)
    else:
        scores = logits.sigmoid()
        biased = scores if expert_bias is None else scores + expert_bias.float()
        if cfg.expert_groups > 1:  # keep the groups whose 2 best biased scores sum highest
            grouped = biased.unflatten(-1, (cfg.expert_groups, -1))
            best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(cfg.groups_kept, dim=-1).indices
            kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(-1, best_groups, True)
            biased = biased.masked_fill(~kept.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
        chosen = biased.topk(k, dim=-1).indices
        weights = scores.gather(-1, chosen)
    if cfg.normalize_weights:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen, weights * cfg.routed_scaling


class SparseMoE(nn.Module):
    """The routed experts (stacked) plus the shared expert; forward(x [..., d], kernels, invariant) -> [..., d].
    `cfg` is the rank's shard (parallel.shard_config: its part of every expert's intermediate dimension)."""

    stacks = ("w_gate_up", "w_down")  # [experts, ...] parameters: one checkpoint tensor (or two) an expert

    def __init__(self, cfg: MoEConfig, tp: TensorParallel):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        E, d, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
        self.experts = tp.part(E) if tp.expert_parallel else slice(0, E)  # the experts this rank holds
        held = self.experts.stop - self.experts.start
        self.router_weight = nn.Parameter(torch.empty(E, d))
        self.expert_bias = nn.Parameter(torch.empty(E)) if cfg.expert_bias else None
        self.w_gate_up = nn.Parameter(torch.empty(held, 2 * inter, d))
        self.w_down = nn.Parameter(torch.empty(held, d, inter))
        self.shared = None
        if cfg.shared_intermediate_size:
            self.shared = GatedMLP(cfg, tp, cfg.shared_intermediate_size)
        self.fp8_params: tuple[str, ...] = ()  # the stacks held in FP8, each with a `{name}_scale` buffer

    def quantize_experts(self):
        """Hold the experts' stacks in E4M3 with a scale per expert and output channel (filled by `set_fp8`)."""
        for name in self.stacks:
            stack = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(stack.shape, dtype=FP8, device=stack.device),
                                             requires_grad=False))
            self.register_buffer(f"{name}_scale", torch.ones(stack.shape[:2], device=stack.device))
        self.fp8_params = self.stacks

    @torch.no_grad()
    def set_fp8(self, name: str, weight: torch.Tensor, index: tuple | None, columns: slice | None = None):
        """Quantise `weight` (one expert's matrix, or the whole stack with index None) into the stack `name` at
        `index`; `columns`: only these of its columns are this rank's (a row-parallel shard, each output channel's
        scale still that of its whole row)."""
        values, scale = quantize_rows_ref(weight)
        index = index or ()
        getattr(self, name)[index] = values if columns is None else values[..., columns]
        getattr(self, f"{name}_scale")[index] = scale

    def forward(self, x: torch.Tensor, kernels: bool = False, invariant: bool = False) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        logits = F.linear(rows.float(), self.router_weight.float())
        chosen, weights = (route_kernel if kernels else route)(logits, self.cfg, self.expert_bias)
        foreign = self.tp.expert_parallel
        if foreign:  # the pairs of other ranks' experts get id -1: no expert here
            held = (chosen >= self.experts.start) & (chosen < self.experts.stop)
            chosen = torch.where(held, chosen - self.experts.start, -1)
        if self.fp8_params:
            stacks = (Fp8Rows(self.w_gate_up, self.w_gate_up_scale), Fp8Rows(self.w_down, self.w_down_scale))
            experts = functools.partial(moe_experts_fp8, foreign=foreign) if kernels else moe_experts_fp8_ref
        else:
            stacks = (self.w_gate_up, self.w_down)
            experts = functools.partial(moe_experts, foreign=foreign) if kernels else moe_experts_ref
        out = experts(rows, chosen, weights, *stacks)
        if self.shared is not None:  # its rank's partial sum, added before the one all-reduce
            out = out + self.shared.partial(rows, kernels, invariant)
        return self.tp.all_reduce(out).view_as(x)

    def checkpoint_placements(self, kind: str) -> dict[str, tuple[tuple, object]]:
        """This block's checkpoint tensors of parameter `kind`, named below its checkpoint prefix (`gate.weight`,
        `experts.{e}.gate_proj.weight`, ...) -> (the index of the parameter it fills, the part of the tensor this
        rank loads: a models.base.Shard, or None)."""
        from .base import ELSEWHERE, Shard  # base builds the layers, this module among them

        if kind == "router_weight":
            return {"gate.weight": ((), None)}
        if kind == "expert_bias":
            return {"gate.expert_bias": ((), None)}
        inter = self.cfg.expert_intermediate_size
        if self.tp.expert_parallel or self.tp.size == 1:
            shard = None
        else:
            whole = inter * self.tp.size
            part = self.tp.part(whole)
            shard = Shard(0 if kind == "w_gate_up" else 1, part.start, part.stop, whole)
        placements = {}
        for e in range(self.cfg.num_experts):
            # another rank's expert: this rank checks its shape (that of any expert's) and reads none of it
            here, e_shard = (e - self.experts.start, shard) if self.experts.start <= e < self.experts.stop else \
                (0, ELSEWHERE)
            if kind == "w_gate_up":
                placements[f"experts.{e}.gate_proj.weight"] = ((here, slice(0, inter)), e_shard)
                placements[f"experts.{e}.up_proj.weight"] = ((here, slice(inter, 2 * inter)), e_shard)
            else:
                placements[f"experts.{e}.down_proj.weight"] = ((here,), e_shard)
        return placements
