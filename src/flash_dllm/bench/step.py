"""`flash-dllm bench step`: the engine's denoising step (forward, sampling, unmasking, bookkeeping)
on a batch of equal requests, against the floor of its forward."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams
from .roofline import floor_seconds, forward_flops


@dataclass(frozen=True)
class StepResult:
    method: str
    batch: int
    prompt: int
    gen: int
    ms_per_step: float
    tokens_per_step: float
    floor_ms: float
    peak_gb: float

    @property
    def ratio(self) -> float:
        return self.ms_per_step / self.floor_ms


def bench_step(llm, params: SamplingParams, batch: int, prompt_length: int, warmup: int = 3,
               iters: int = 20, seed: int = 0) -> StepResult:
    """Steady-state time per step: `iters` consecutive engine steps after `warmup` steps, timed as one
    span with a synchronisation at each end (each step already syncs once to retire finished rows)."""
    cfg, engine = llm.config, llm.engine
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_length), generator=generator)
    prompts[prompts == llm.special.mask_id] = llm.special.pad_id
    seqs = [engine.add_request(p.tolist(), params) for p in prompts]
    if llm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(llm.device)
    for _ in range(warmup):
        engine.step()
    decoded_before = _decoded(engine, llm.special.mask_id)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        engine.step()
    sync()
    ms = (time.perf_counter() - start) * 1e3 / iters
    tokens = (_decoded(engine, llm.special.mask_id) - decoded_before) / (iters * batch)
    peak = torch.cuda.max_memory_allocated(llm.device) / 1e9 if llm.device.type == "cuda" else float("nan")
    while engine.has_unfinished():  # leave the engine empty; finishing is not timed
        engine.step()
    assert all(seq.is_finished for seq in seqs)
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    flops = forward_flops(cfg, batch, prompt_length + params.max_tokens, params.block_length)
    flops *= 2 if params.guidance > 0 else 1
    return StepResult(params.method, batch, prompt_length, params.max_tokens, ms, tokens,
                      floor_seconds(weight_bytes, flops)[2] * 1e3, peak)


def _decoded(engine, mask_id: int) -> int:
    batch = engine.batch
    return int((batch.tokens[:, batch.gen_start:] != mask_id).sum())
