"""`flash-dllm bench forward`: one full forward pass against the roofline floor."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..markdown import markdown_table
from .roofline import floor_seconds, forward_flops


@dataclass(frozen=True)
class ForwardResult:
    batch: int
    length: int
    logit_rows: int
    ms: float
    floor_ms: float
    bytes_floor_ms: float
    flops_floor_ms: float
    tflops: float
    peak_gb: float

    @property
    def ratio(self) -> float:
        return self.ms / self.floor_ms


def time_ms(fn, warmup: int, iters: int, device: torch.device) -> float:
    """Median wall time of fn() in ms; CUDA events on the GPU, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_time_ms(fn, device: torch.device, calls: int = 20, iters: int = 10) -> float:
    """Median GPU time of one fn() in ms, from CUDA graphs of `calls` calls replayed back to back: a kernel of a few
    microseconds timed alone measures its launch (Triton's from Python: tens of microseconds), which the engine's
    graphs do not pay. CPU: time_ms."""
    if device.type != "cuda":
        return time_ms(fn, 1, iters, device)
    fn()  # compiles, and cuBLAS's workspace, outside the capture
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_ms(graph.replay, 2, iters, device) / calls


@torch.inference_mode()
def bench_forward(model, batch: int, length: int, logit_rows: int | None = None, warmup: int = 3,
                  iters: int = 10, seed: int = 0) -> ForwardResult:
    """Time one forward over [batch, length] random ids; the LM head runs on the last `logit_rows` rows of
    each sequence (all rows if None: what LLaDA's reference code does)."""
    cfg = model.config
    device = next(model.parameters()).device
    logit_rows = length if logit_rows is None else logit_rows
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), device=device, generator=generator)

    def forward():
        hidden = model.hidden_states(ids)
        return model.compute_logits(hidden[:, length - logit_rows:])

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = time_ms(forward, warmup, iters, device)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flops = forward_flops(cfg, batch, length, logit_rows)
    memory_s, compute_s, floor_s = floor_seconds(weight_bytes, flops)
    return ForwardResult(batch, length, logit_rows, ms, floor_s * 1e3, memory_s * 1e3, compute_s * 1e3,
                         flops / (ms * 1e-3) / 1e12, peak)


def format_table(results: list[ForwardResult]) -> str:
    header = ("batch", "length", "LM-head rows", "ms", "bytes floor ms", "FLOP floor ms", "x floor",
              "TFLOP/s", "peak GB")
    rows = [(r.batch, r.length, r.logit_rows, f"{r.ms:.2f}", f"{r.bytes_floor_ms:.2f}", f"{r.flops_floor_ms:.2f}",
             f"{r.ratio:.2f}", f"{r.tflops:.0f}", f"{r.peak_gb:.1f}") for r in results]
    return markdown_table(header, rows)

