"""Which masked positions of the current block are unmasked in a step.

Each rule takes confidence [B, n] (-inf where the position is not masked) and the mask [B, n] and
returns the positions to unmask [B, n] as a bool tensor; per-row settings are [B] tensors.
"""
from __future__ import annotations

import torch


def confidence_ranks(confidence: torch.Tensor) -> torch.Tensor:
    """Rank of each position in descending confidence (0 = most confident); ties keep position order."""
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return ranks.scatter_(-1, order, positions)


def linear_schedule(block_length: torch.Tensor, steps: torch.Tensor, step_in_block: torch.Tensor) -> torch.Tensor:
    """LLaDA's tokens per step [B]: each row's block length spread evenly over its block's steps, the first
    (block_length % steps) steps get one more."""
    return block_length // steps + (step_in_block < block_length % steps).long()


def transfer_top_k(confidence: torch.Tensor, masked: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return masked & (confidence_ranks(confidence) < k[:, None])


def transfer_threshold(confidence: torch.Tensor, masked: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Fast-dLLM: every position with confidence >= threshold, and always the most confident one."""
    return masked & ((confidence >= threshold[:, None]) | (confidence_ranks(confidence) == 0))


def transfer_factor(confidence: torch.Tensor, masked: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Fast-dLLM's factor rule: the longest prefix of n confidence-sorted positions with
    (n + 1) * (1 - c_n) < factor for every n in it, and at least one."""
    ordered = torch.sort(confidence, dim=-1, descending=True).values
    n = torch.arange(1, ordered.shape[-1] + 1, device=ordered.device)
    passes = ((n + 1) * (1 - ordered) < factor[:, None]).long()
    count = passes.cumprod(dim=-1).sum(dim=-1).clamp(min=1)
    return masked & (confidence_ranks(confidence) < count[:, None])
