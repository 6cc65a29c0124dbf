"""The weight-read floor of one block-diffusion step of a mixture-of-experts model: the bytes of the weights a step
touches over the GPU's memory bandwidth (H200 4.25 TB/s, H100 3.35).

    python benchmarks/moe_floor.py --model random:llada2-mini --batch-sizes 1 32 [--quantization fp8]

A step computes `block_length` query rows per sequence. Every layer reads its attention, norms, router and shared or
dense MLP; an MoE layer reads the experts its rows choose: with N routed rows and top-k of E experts chosen
uniformly, E (1 - (1 - k/E)^N) distinct ones in expectation (random weights route near uniformly; a trained model's
routing is skewed, which touches fewer). The LM head is read once a step (the block's logits); the KV cache's and
the activations' bytes are not counted (a step's keys: ~64 MB at batch 32 x 1k tokens on LLaDA2-mini, against
~1.5-4 GB of weights).
"""
from __future__ import annotations

import argparse

import torch

from flash_dllm.models import build_model
from flash_dllm.models.loader import random_config

BANDWIDTH = {"H200": 4.25e12, "H100": 3.35e12}


def floor_bytes(spec: str, batch: int, rows_per_sequence: int, weight_bytes: int) -> tuple[float, float]:
    """(bytes a step reads, distinct experts touched per MoE layer) for `batch` sequences."""
    cfg = random_config(spec)
    model = build_model(cfg, "meta", torch.bfloat16)
    per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size * weight_bytes
    dense = sum(p.numel() for name, p in model.named_parameters()
                if not name.startswith("embed") and ".w_" not in name) * 2
    if weight_bytes == 1:  # FP8: the projections of the layers (not the norms, router, LM head) at one byte
        linear = sum(p.numel() for name, p in model.named_parameters()
                     if name.startswith("layers.") and name.endswith("proj.weight"))
        dense -= linear
    rows = batch * rows_per_sequence
    E, k = cfg.num_experts, cfg.experts_per_token
    touched = E * (1 - (1 - k / E) ** rows)
    moe_layers = cfg.num_layers - cfg.dense_layers
    return dense + moe_layers * touched * per_expert, touched


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llada2-mini")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--quantization", choices=["fp8"])
    parser.add_argument("--gpu", choices=list(BANDWIDTH), default="H200")
    args = parser.parse_args()
    spec = args.model.removeprefix("random:")
    weight_bytes = 1 if args.quantization == "fp8" else 2
    print(f"| model | weights | batch | experts touched / layer | GB read / step | floor ms ({args.gpu}) |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        read, touched = floor_bytes(spec, batch, args.block_length, weight_bytes)
        print(f"| {spec} | {args.quantization or 'bf16'} | {batch} | {touched:.1f} | {read / 1e9:.2f} | "
              f"{read / BANDWIDTH[args.gpu] * 1e3:.3f} |")


if __name__ == "__main__":
    main()
