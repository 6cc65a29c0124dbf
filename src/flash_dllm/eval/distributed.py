"""Data-parallel evaluation: under `torchrun --nproc_per_node N`, each rank decodes a strided shard of the
items and the ranks exchange their records, so that every rank holds the merged results in item order."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str | None:
        """Each rank's own GPU under torchrun; None leaves the choice to the LLM."""
        return f"cuda:{self.local_rank}" if self.world_size > 1 and torch.cuda.is_available() else None


def init_from_env(tensor_parallel_size: int = 1) -> DistContext:
    """A process group from torchrun's environment (NCCL on GPUs, gloo on the CPU), or a single process. Under
    tensor parallelism torchrun's ranks are the LLM's tensor-parallel group (it joins it), not data-parallel ones:
    one process here."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or tensor_parallel_size > 1:
        return DistContext()
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)  # NCCL's object collectives use the current device
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank)


def shutdown(ctx: DistContext):
    if ctx.world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank tears its connections down while another still talks (gloo aborts then)
        dist.destroy_process_group()


def shard(items: list, ctx: DistContext) -> list:
    """Every world_size-th item from this rank's offset: long and short items spread evenly over ranks."""
    return items[ctx.rank::ctx.world_size]


def all_gather(obj, ctx: DistContext) -> list:
    """One object per rank, in rank order, on every rank."""
    if ctx.world_size == 1:
        return [obj]
    import torch.distributed as dist

    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered
