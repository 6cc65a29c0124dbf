"""`flash-dllm bench step`: the engine's decoding iteration (forward passes, sampling, unmasking,
bookkeeping) per method and batch size, against the roofline floor of the work it did.

Forced schedule: with a random-weight model the confidences are flat, so no position reaches a
threshold and every threshold rule decodes its minimum of one token per iteration, `reference` decodes
one per step (steps = max_tokens), and Flash-Verify's verify pass accepts nothing (its iteration is
draft + verify and still decodes one). The decoding work is then identical across methods, which differ
only in the query rows (and passes) an iteration computes. Stop tokens are ignored so that no request
finishes early. The measured tokens per iteration are reported; `forced` says whether they were 1.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import time
from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..decoding.registry import method_of
from ..engine.llm_engine import LLMEngine
from ..engine.model_runner import ModelRunner
from ..sampling_params import SamplingParams
from ..markdown import markdown_table
from .roofline import floor_seconds, iteration_cost, weight_bytes_read

MODELLED_TOKENS_PER_ITER = (1.0, 2.8, 5.7)  # tokens/s as if each iteration decoded this many per request


@dataclass(frozen=True)
class StepResult:
    method: str
    routing: str            # the prompt KV's routing and budget, or "dense"
    batch: int
    block: int | None       # None: the method has no blocks
    ms_per_iter: float
    tokens_per_iter: float  # per request, measured
    query_rows: float       # per request and iteration, from the engine's counters
    passes: float           # forward passes per request and iteration
    prompt_kv_read: float   # the fraction of the prompt's keys the timed steps read (1: dense)
    bytes_floor_ms: float
    flops_floor_ms: float
    peak_gb: float
    working_gb: float       # peak less the weights and the KV cache (the working memory)
    tp_size: int = 1        # tensor-parallel ranks (each holds 1/tp_size of the weights and the cache)
    collective_ms: float = 0.0  # per iteration: the driver's wall time in the tensor-parallel collectives

    @property
    def floor_ms(self) -> float:
        return max(self.bytes_floor_ms, self.flops_floor_ms)

    @property
    def ratio(self) -> float:
        return self.ms_per_iter / self.floor_ms

    @property
    def forced(self) -> bool:
        return self.tokens_per_iter == 1.0

    def tokens_per_s(self, tokens_per_iter: float) -> float:
        return self.batch * tokens_per_iter / (self.ms_per_iter * 1e-3)


def bench_step(llm, params: SamplingParams, batch: int, prompt_length: int, warmup: int = 8,
               iters: int = 64, seed: int = 0) -> StepResult:
    """Steady-state time per iteration: `iters` consecutive engine steps after `warmup` steps, timed as one
    span with a synchronisation at each end (each step already syncs once to retire finished rows). With one
    token per iteration, `iters` a multiple of the block length times a cache refresh at its true rate.

    Each call runs a fresh engine whose KV cache holds exactly this batch, so the peak memory is weights +
    that cache + the step's working memory; the engine is dropped unfinished (finishing is not timed).

    Under tensor parallelism every rank runs this function (Workers.everywhere; the result is the driver's) and the
    time in collectives is measured over the timed steps (on a GPU with CUDA events, not inside CUDA graphs)."""
    cfg, device = llm.config, llm.device
    if warmup < 1 or iters < 1:  # the first step builds the batch (and makes the one-off full first pass)
        raise ValueError(f"warmup and iters must be at least 1, got {warmup} and {iters}")
    if warmup + iters > params.max_tokens:
        raise ValueError(f"warmup + iters ({warmup + iters}) must not exceed max_tokens ({params.max_tokens}): "
                         f"the requests would finish inside the timed span")
    method = method_of(params.method, cfg.attention.kind)
    length = prompt_length + params.max_tokens + method.tail_tokens(params)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_length), generator=generator)
    prompts[prompts == llm.special.mask_id] = llm.special.pad_id
    if device.type == "cuda":
        gc.collect()  # the previous call's engine (its cache, its graphs) sits in reference cycles until collected
        torch.cuda.reset_peak_memory_stats(device)
    cache_bytes = batch * length * KVCache.bytes_per_row(llm.model.shard_config, llm.dtype,
                                                         with_hidden=method.caches_hidden_states,
                                                         kv_dtype=llm.runner.kv_dtype)
    runner = ModelRunner(llm.model, kernels=llm.runner.kernels, cuda_graphs=llm.runner.cuda_graphs,
                         kv_cache_bytes=cache_bytes, batch_invariant=llm.runner.batch_invariant,
                         kv_cache_dtype=llm.runner.kv_cache_dtype)
    engine = LLMEngine(runner, dataclasses.replace(llm.special, stop_ids=()), batch)
    for p in prompts:
        engine.add_request(p.tolist(), params)
    for _ in range(warmup):
        engine.step()
    before = _counters(engine, llm.special.mask_id)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    timer = llm.model.tp.timer
    timer.reset(enabled=True)
    start = time.perf_counter()
    for _ in range(iters):
        engine.step()
    sync()
    ms = (time.perf_counter() - start) * 1e3 / iters
    collective_ms = timer.seconds() * 1e3 / iters
    timer.reset(enabled=False)
    after = _counters(engine, llm.special.mask_id)
    tokens, rows, passes = ((a - b) / (iters * batch) for a, b in zip(after[:3], before[:3]))
    keys_read, keys_dense = after[3] - before[3], after[4] - before[4]
    read = keys_read / keys_dense if keys_dense else 1.0
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    resident = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    resident += runner.cache.nbytes if runner.cache is not None else 0  # methods without a cache
    keys = length - prompt_length * (1 - read)  # read per request and pass
    num_bytes, flops = iteration_cost(cfg, batch, keys, rows, passes, weight_bytes_read(llm.model),
                                      KVCache.bytes_per_row(cfg, llm.dtype, kv_dtype=llm.runner.kv_dtype))
    memory_s, compute_s, _ = floor_seconds(num_bytes, flops)
    routing = f"{params.kv_routing} {params.kv_budget:g}" if params.kv_routing else "dense"
    return StepResult(params.method, routing, batch, params.block_length if method.uses_blocks else None, ms,
                      tokens, rows, passes, read, memory_s * 1e3, compute_s * 1e3, peak, peak - resident / 1e9,
                      llm.model.tp.size, collective_ms)


def _counters(engine, mask_id: int) -> tuple[int, ...]:
    """Decoded generated tokens, query rows, forward passes, routed prompt keys read and their dense count so
    far, summed over the batch. An elastic refresh is not a pass here (its weight re-read is left out of the
    floor); its rows count at full depth."""
    batch, counters = engine.batch, engine.batch.counters
    decoded = int((batch.tokens[:, batch.gen_start:] != mask_id).sum())
    return (decoded, sum(row.query_rows for row in batch.rows), int(counters.nfe.sum()),
            int(counters.prompt_keys_read.sum()), int(counters.prompt_keys_dense.sum()))


def format_table(results: list[StepResult]) -> str:
    header = ("method", "prompt KV", "read", "batch", "block", "ms/iter", "tokens/iter/req", "query rows/iter/req",
              "passes/iter",
              "bytes floor ms", "FLOP floor ms", "x floor", "peak GB", "peak - weights - cache GB",
              *(f"tok/s @{k}" for k in MODELLED_TOKENS_PER_ITER))
    rows = [(r.method, r.routing, f"{r.prompt_kv_read:.3f}", r.batch, "-" if r.block is None else r.block,
             f"{r.ms_per_iter:.2f}", f"{r.tokens_per_iter:.2f}", f"{r.query_rows:.0f}", f"{r.passes:.2f}",
             f"{r.bytes_floor_ms:.3g}", f"{r.flops_floor_ms:.3g}", f"{r.ratio:.2f}",
             *("-" if math.isnan(gb) else f"{gb:.2f}" for gb in (r.peak_gb, r.working_gb)),  # nan: not on a GPU
             *(f"{r.tokens_per_s(k):.0f}" for k in MODELLED_TOKENS_PER_ITER)) for r in results]
    return markdown_table(*with_tensor_parallel(header, rows, results, "ms/iter"))


def with_tensor_parallel(header: tuple, rows: list[tuple], results: list, after: str) -> tuple[tuple, list[tuple]]:
    """Under tensor parallelism, the columns `TP` (the ranks) and `collectives ms/iter` after the column `after`."""
    if all(r.tp_size == 1 for r in results):
        return header, rows
    at = header.index(after) + 1
    insert = lambda row, values: (*row[:at], *values, *row[at:])
    return (insert(header, ("TP", "collectives ms/iter")),
            [insert(row, (r.tp_size, f"{r.collective_ms:.2f}")) for row, r in zip(rows, results)])
