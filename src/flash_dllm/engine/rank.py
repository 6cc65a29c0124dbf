"""What one rank builds: its RankSpec (the LLM's arguments that shape the model, its runner and its engine) and
build_rank, shared by the LLM (one process, or tensor parallelism's driver) and the worker ranks
(engine/tensor_parallel.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models import DiffusionLM, load_model, random_model
from ..models.parallel import TensorParallel
from .model_runner import ModelRunner

RANDOM_PREFIX = "random:"  # a model "random:PRESET": random weights of a named config


@dataclass(frozen=True)
class RankSpec:
    """What a rank builds: the LLM's arguments that shape the model, its runner and its engine."""
    model: str
    device: torch.device  # the driver's; rank r runs on the GPU r after it, or on the CPU
    dtype: torch.dtype
    seed: int
    quantization: str | None
    kv_cache_bytes: int | None
    kernels: bool | None
    cuda_graphs: bool | None
    batch_invariant: bool
    kv_cache_dtype: str | None
    max_batch_size: int
    expert_parallel: bool = False

    def device_of(self, rank: int) -> torch.device:
        if self.device.type != "cuda":
            return self.device
        return torch.device("cuda", (self.device.index or 0) + rank)


def build_rank(spec: RankSpec, device: torch.device, tp: TensorParallel | None = None,
               runner: Callable[..., ModelRunner] = ModelRunner) -> tuple[DiffusionLM, ModelRunner]:
    """The model (this rank's shard under tensor parallelism `tp`) on `device`, and its runner, made by `runner` (the
    driver's: a MirroredRunner bound to its workers)."""
    if spec.model.startswith(RANDOM_PREFIX):
        model = random_model(spec.model[len(RANDOM_PREFIX):], device, spec.dtype, seed=spec.seed,
                             quantization=spec.quantization, tp=tp)
    else:
        model = load_model(spec.model, device, spec.dtype, spec.quantization, tp=tp)
    return model, runner(model, kernels=spec.kernels, cuda_graphs=spec.cuda_graphs, kv_cache_bytes=spec.kv_cache_bytes,
                         batch_invariant=spec.batch_invariant, kv_cache_dtype=spec.kv_cache_dtype)
