"""Tensor parallelism inside the model (Megatron-style): which part of each weight a rank holds, and the collectives
that join the ranks' partial results.

- Column-parallel (q|k|v, gate|up): a rank computes its own output rows: its query heads, its KV heads (a KV head
  is replicated on the ranks that share it where the ranks outnumber the KV heads), its share of the MLP's
  intermediate features. The attention and the KV cache of a rank hold its heads only.
- Row-parallel (o_proj, down_proj): a rank multiplies its share of the input features; one all-reduce sums the
  ranks' products, the bias is added once after it.
- Vocabulary-parallel embedding and LM head: a rank holds a contiguous range of the vocabulary's rows; the
  embedding is summed over ranks (each looks up the ids it holds, zeros elsewhere), and the LM head's logits are
  gathered over ranks, for the rows a step asks logits of only.

Every rank gets bit-identical gathered and reduced values, so every rank takes the same decoding decisions (the
engine's, the methods'); `engine/tensor_parallel.py` runs the ranks. With size 1 every collective is the identity.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


@dataclass
class CollectiveTimer:
    """Wall time spent in collectives while `enabled` (bench step and bench generate turn it on). On the CPU (gloo)
    the collectives are synchronous and timed with the host clock; on a GPU they are timed with CUDA events around
    them, read at `seconds()` (one sync), and not at all inside a CUDA graph capture or replay."""

    enabled: bool = False
    calls: int = 0
    host_s: float = 0.0
    events: list = field(default_factory=list)

    def reset(self, enabled: bool = True):
        self.enabled, self.calls, self.host_s, self.events = enabled, 0, 0.0, []

    def seconds(self) -> float:
        if self.events:
            torch.cuda.synchronize()
            self.host_s += sum(start.elapsed_time(end) for start, end in self.events) / 1e3
            self.events = []
        return self.host_s


@dataclass
class TensorParallel:
    """One rank's place in a tensor-parallel group: rank in [0, size); `group` the process group of its device's
    collectives (NCCL on GPUs, gloo on the CPU; None with size 1). ordered: every reduction in one fixed order
    (the batch-invariant mode): an all-reduce is an all-gather and a sum in rank order, so a value's sum never
    depends on the buffer's size (a ring all-reduce's order does, beyond two ranks)."""

    rank: int = 0
    size: int = 1
    group: object = None
    ordered: bool = False
    expert_parallel: bool = False  # a mixture of experts' experts placed whole on the ranks, not each split
    timer: CollectiveTimer = field(default_factory=CollectiveTimer)

    def part(self, n: int) -> slice:
        """This rank's contiguous share of n (divisible by size) things: heads, features, vocabulary rows."""
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """This rank's KV heads: its share, or where the ranks outnumber them (size a multiple of num_kv_heads), the
        one KV head that its query heads read (the ranks num_kv_heads apart share it)."""
        if num_kv_heads >= self.size:
            return self.part(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return slice(head, head + 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over ranks (x is reused as the result where it can be)."""
        if self.size == 1:
            return x
        with _Timed(self.timer, x.is_cuda):
            if self.ordered:
                parts = self._gathered(x)
                x = parts[0]
                for part in parts[1:]:
                    x = x + part
                return x
            x = x.contiguous()
            torch.distributed.all_reduce(x, group=self.group)
            return x

    def min(self, value: int, device: torch.device) -> int:
        """The least of the ranks' values (a size every rank can hold: the KV cache's)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' x concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        with _Timed(self.timer, x.is_cuda):
            return torch.cat(self._gathered(x), dim=dim)

    def _gathered(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        return parts


class _Timed:
    """A collective's span, added to the timer if it is enabled."""

    def __init__(self, timer: CollectiveTimer, cuda: bool):
        self.timer, self.cuda, self.start = timer, cuda, None

    def __enter__(self):
        timer = self.timer
        if not timer.enabled or (self.cuda and torch.cuda.is_current_stream_capturing()):
            return
        timer.calls += 1
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        timer = self.timer
        if self.start is None:
            return
        if not self.cuda:
            timer.host_s += time.perf_counter() - self.start
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timer.events.append((self.start, end))



def valid_sizes(cfg: ModelConfig, expert_parallel: bool = False) -> list[int]:
    """The tensor-parallel sizes this model splits into: each rank the same number of query heads, of KV heads (or
    one KV head shared by size / num_kv_heads ranks), of MLP features and of vocabulary rows; with
    expert_parallel, the same number of whole experts instead of a share of each expert's features."""
    split = {f: getattr(cfg, f) for f in split_widths(cfg, expert_parallel)}
    if expert_parallel:
        split["num_experts"] = cfg.num_experts
    return [n for n in range(1, cfg.num_heads + 1)
            if not (cfg.num_heads % n or cfg.vocab_size % n or any(width % n for width in split.values()))
            and (cfg.num_kv_heads % n == 0 or n % cfg.num_kv_heads == 0)]


def split_widths(cfg: ModelConfig, expert_parallel: bool) -> list[str]:
    """The widths that the ranks split (expert parallelism keeps the experts' whole)."""
    return [f for f in cfg.split_widths if not (expert_parallel and f in cfg.expert_widths)]


def check_size(cfg: ModelConfig, size: int, expert_parallel: bool = False):
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer of at least 1, got {size!r}")
    if expert_parallel and not cfg.expert_widths:
        raise ValueError("expert_parallel places a mixture of experts' experts on the ranks: this model has none")
    if expert_parallel and size == 1:
        raise ValueError("expert_parallel places the experts on the tensor-parallel ranks: it needs "
                         "tensor_parallel_size > 1")
    sizes = valid_sizes(cfg, expert_parallel)
    if size not in sizes:
        widths = [*split_widths(cfg, expert_parallel), *(["num_experts"] if expert_parallel else [])]
        raise ValueError(f"tensor_parallel_size={size} does not split this model ({cfg.num_heads} heads, "
                         f"{cfg.num_kv_heads} KV heads, {', '.join(f'{f}={getattr(cfg, f)}' for f in widths)}, "
                         f"vocabulary {cfg.vocab_size}); valid sizes: {', '.join(map(str, sizes))}")


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes of one rank's decoder layers and KV cache: its query heads, KV heads and MLP features (the hidden
    size, head size and vocabulary stay the model's; so do num_experts and, with expert parallelism, the experts'
    width: the MoE block holds its rank's share of whole experts)."""
    if tp.size == 1:
        return cfg
    check_size(cfg, tp.size, tp.expert_parallel)
    kv = tp.kv_heads(cfg.num_kv_heads)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=kv.stop - kv.start,
                               **{f: getattr(cfg, f) // tp.size for f in split_widths(cfg, tp.expert_parallel)})


class VocabParallelEmbedding(nn.Embedding):
    """The embedding's rows tp.part(vocab_size) on this rank; a lookup sums the ranks' rows (one all-reduce)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        self.vocab = tp.part(vocab_size)
        super().__init__(self.vocab.stop - self.vocab.start, dim)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab.start
        held = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(rows * held[..., None])
