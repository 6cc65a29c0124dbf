"""How cuBLAS's GEMMs of one LLaDA-8B layer scale with the query rows of a pass (H200, bf16): the time of the
four projections (qkv, o, gate_up, down) per layer at each row count, against the weight-read floor and the
FLOP floor. Each row count's four GEMMs are captured in one CUDA graph and replayed (no launch gaps).
With --invariant, the same for the batch-invariant GEMM (kernels/invariant_matmul.py), its time against
cuBLAS's, and whether its first row is bit-identical to that row computed alone.

    PYTHONPATH=src python benchmarks/gemm_rows.py --rows 16 32 64 112 128 144 160 192 256 320 512 [--invariant]
"""
from __future__ import annotations

import argparse

import torch

from flash_dllm.kernels.invariant_matmul import invariant_matmul
from flash_dllm.models.loader import random_config

BANDWIDTH, PEAK_FLOPS = 4.25e12, 787e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 112, 128, 144, 160, 192, 256, 320, 512])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--invariant", action="store_true", help="also time and check the batch-invariant GEMM")
    args = ap.parse_args()
    cfg = random_config(args.model)
    d, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"qkv": (q + 2 * kv, d), "o": (d, q), "gate_up": (2 * ff, d), "down": (d, ff)}
    weights = {name: torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02
               for name, shape in shapes.items()}
    weight_bytes = sum(w.numel() * 2 for w in weights.values())
    print("| rows | " + " | ".join(f"{n} us" for n in shapes)
          + " | layer us | bytes floor us | FLOP floor us | x floor |"
          + (" invariant layer us | x cuBLAS | row 0 as alone |" if args.invariant else ""))
    print("|---" * (len(shapes) + 5 + 3 * args.invariant) + "|")
    for rows in args.rows:
        inputs = {name: torch.randn(rows, w.shape[1], dtype=torch.bfloat16, device="cuda")
                  for name, w in weights.items()}
        times = {name: timed_us(lambda: torch.nn.functional.linear(inputs[name], w), args.replays)
                 for name, w in weights.items()}
        layer = sum(times.values())
        activations = 2 * rows * sum(w.shape[0] + w.shape[1] for w in weights.values())
        bytes_floor = (weight_bytes + activations) / BANDWIDTH * 1e6
        flop_floor = 2 * rows * weight_bytes / 2 / PEAK_FLOPS * 1e6
        line = (f"| {rows} | " + " | ".join(f"{times[n]:.1f}" for n in shapes) +
                f" | {layer:.1f} | {bytes_floor:.1f} | {flop_floor:.1f} | {layer / max(bytes_floor, flop_floor):.2f} |")
        if args.invariant:
            invariant = sum(timed_us(lambda: invariant_matmul(inputs[name], w), args.replays)
                            for name, w in weights.items())
            alone = all(torch.equal(invariant_matmul(inputs[name][:1], w), invariant_matmul(inputs[name], w)[:1])
                        for name, w in weights.items())
            line += f" {invariant:.1f} | {invariant / layer:.2f} | {alone} |"
        print(line, flush=True)


def timed_us(fn, replays: int) -> float:
    """fn's time in us, from `replays` calls captured in one CUDA graph."""
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


if __name__ == "__main__":
    main()
