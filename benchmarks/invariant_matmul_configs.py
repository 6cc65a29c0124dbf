"""The batch-invariant GEMM's tilings on the GPU (LLaDA-8B's shapes, bf16): whether every tiling gives the same
bits (the kernel's claim: K never split, so an element's additions do not depend on the tile), and each one's
time against cuBLAS per row count, to fill kernels/invariant_matmul.py's CONFIGS.

    PYTHONPATH=src python benchmarks/invariant_matmul_configs.py [--rows 1 16 55 144 ...] [--write]

--write stores the best tilings of each row count as the bf16 and fp16 tables of kernels/invariant_matmul.json:
one for the wide GEMMs (qkv, gate_up: their time summed) and one for the narrow (o, down: no more outputs than
inputs), all of one K step (the one with the least time over the row counts: the CPU
interpreter's dot sums a whole K step at once, so only there does the K step change the bits); it refuses when
any tiling gives other bits.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import flash_dllm.kernels.invariant_matmul as module
from flash_dllm.kernels.invariant_matmul import CONFIGS, invariant_matmul
from flash_dllm.models.loader import random_config
from gemm_rows import timed_us  # benchmarks/: one CUDA-graph timing for both GEMM benchmarks

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP: weights as the MMA's rows, for few input rows[, TAIL:
# rows after BLOCK_M in the same row tile, a second accumulator])
CANDIDATES = [(64, 32, 128, 4, 4, False), (64, 64, 64, 4, 6, False), (64, 64, 128, 4, 4, False),
              (64, 128, 64, 4, 4, False), (64, 256, 64, 4, 3, False), (128, 128, 64, 4, 4, False),
              (128, 128, 64, 8, 3, False), (128, 256, 64, 8, 4, False), (256, 128, 64, 8, 3, False),
              (128, 128, 128, 8, 3, False), (16, 64, 128, 4, 4, False), (16, 128, 64, 4, 4, False),
              (16, 64, 128, 4, 4, True), (16, 128, 64, 4, 4, True), (32, 64, 128, 4, 4, True),
              (32, 128, 64, 4, 4, True), (64, 64, 128, 4, 4, True), (64, 128, 64, 4, 4, True),
              (128, 64, 64, 4, 4, True), (128, 128, 64, 8, 3, True), (256, 64, 64, 8, 3, True),
              (256, 128, 64, 8, 3, True), (64, 64, 64, 4, 4, True, 16), (64, 64, 64, 4, 4, True, 32),
              (128, 64, 64, 4, 4, True, 16), (128, 64, 64, 8, 4, True, 16), (128, 128, 64, 8, 3, True, 16),
              (128, 64, 64, 4, 4, True, 32), (128, 64, 64, 4, 4, True, 64), (128, 64, 64, 8, 3, True, 128),
              (128, 128, 64, 8, 3, True, 128), (128, 32, 64, 4, 4, True, 16), (128, 32, 64, 4, 6, True, 16)]


REPLAYS = 20


def as_config(c):
    return dict(BLOCK_M=c[0], BLOCK_N=c[1], BLOCK_K=c[2], num_warps=c[3], num_stages=c[4], SWAP=c[5],
                TAIL=c[6] if len(c) > 6 else 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 33, 55, 64, 97, 144, 241, 512, 1024, 1760, 4608])
    ap.add_argument("--write", action="store_true", help="store the best tilings in kernels/invariant_matmul.json")
    args = ap.parse_args()
    cfg = random_config("llada-8b")
    d, ff = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv": (3 * d, d), "o": (d, d), "gate_up": (2 * ff, d), "down": (d, ff), "lm_head": (cfg.vocab_size, d)}
    torch.manual_seed(0)
    weights = {n: torch.randn(s, dtype=torch.bfloat16, device="cuda") * 0.02 for n, s in shapes.items()}
    inputs = {n: torch.randn(max(args.rows), w.shape[1], dtype=torch.bfloat16, device="cuda")
              for n, w in weights.items()}

    identical = True
    print("## bits: every tiling against the first, all rows, and row 0 alone against in the batch")
    for name, w in weights.items():
        x = inputs[name][:1024]
        base = invariant_matmul(x, w, as_config(CANDIDATES[0]))
        differ = []
        for c in CANDIDATES:
            out = invariant_matmul(x, w, as_config(c))
            alone = invariant_matmul(x[:1], w, as_config(c))
            if not (torch.equal(out, base) and torch.equal(alone, base[:1])):
                differ.append(f"{c}: {(out.float() - base.float()).abs().max().item():.2e}")
        identical &= not differ
        print(f"{name}: {len(CANDIDATES) - len(differ)}/{len(CANDIDATES)} tilings bit-identical; differ: {differ}",
              flush=True)

    print("\n## time (us) per row count: cuBLAS, the table's tiling, the best tiling for the four layer GEMMs")
    print("| rows | cuBLAS layer | table layer | x cuBLAS | best layer | x cuBLAS | best tiling | per-GEMM best "
          "| cuBLAS lm_head | best lm_head | lm_head tiling |")
    print("|---" * 11 + "|")
    layer, wide, narrow = ("qkv", "o", "gate_up", "down"), ("qkv", "gate_up"), ("o", "down")
    chosen = {k_step: [] for k_step in sorted({c[2] for c in CANDIDATES})}
    for rows in sorted(args.rows):
        cublas = {n: timed_us(lambda: F.linear(inputs[n][:rows], w), REPLAYS) for n, w in weights.items()}
        table = sum(timed_us(lambda: invariant_matmul(inputs[n][:rows], weights[n]), REPLAYS) for n in layer)
        times = {c: {n: timed_us(lambda: invariant_matmul(inputs[n][:rows], w, as_config(c)), REPLAYS)
                     for n, w in weights.items()} for c in CANDIDATES}
        best = min(CANDIDATES, key=lambda c: sum(times[c][n] for n in layer))
        for k_step, picks in chosen.items():
            pick = {names: min((c for c in CANDIDATES if c[2] == k_step), key=lambda c: sum(times[c][n] for n in names))
                    for names in (wide, narrow)}
            spent = sum(times[pick[names]][n] for names in (wide, narrow) for n in names)
            picks.append((rows, (pick[wide], pick[narrow]), spent / sum(cublas[n] for n in layer)))
        best_layer = sum(times[best][n] for n in layer)
        per_gemm = sum(min(times[c][n] for c in CANDIDATES) for n in layer)
        head = min(CANDIDATES, key=lambda c: times[c]["lm_head"])
        cub = sum(cublas[n] for n in layer)
        print(f"| {rows} | {cub:.1f} | {table:.1f} | {table / cub:.2f} | {best_layer:.1f} | {best_layer / cub:.2f} "
              f"| {best} | {per_gemm:.1f} | {cublas['lm_head']:.1f} | {times[head]['lm_head']:.1f} | {head} |",
              flush=True)
        print("   " + "; ".join(f"{c}: " + ",".join(f"{times[c][n]:.0f}" for n in shapes) for c in CANDIDATES),
              flush=True)
    k_step = min(chosen, key=lambda k: sum(ratio for _, _, ratio in chosen[k]))
    picks = [(rows, tiling) for rows, tiling, _ in chosen[k_step]]
    ratios = {k: ", ".join(f"{r:.2f}" for *_, r in picks) for k, picks in chosen.items()}
    print("\nx cuBLAS by K step: " + "; ".join(f"{k}: {r}" for k, r in ratios.items()))
    table = []
    for (rows, tilings), following in zip(picks, picks[1:] + [(None, None)]):
        if tilings != following[1]:  # the last row count of a run of the same tilings
            table.append([rows if following[0] is not None else None, as_config(tilings[0])]
                         + ([as_config(tilings[1])] if tilings[1] != tilings[0] else []))
    print(f"\nbefore: {CONFIGS[torch.bfloat16]}\nbest: {table}")
    if args.write:
        if not identical:
            raise SystemExit("not written: some tilings give other bits")
        path = Path(module.__file__).parent / "invariant_matmul.json"
        tables = json.loads(path.read_text())
        tables["bfloat16"] = tables["float16"] = table
        path.write_text(json.dumps(tables, indent=1) + "\n")
        print(f"written to {path}")


if __name__ == "__main__":
    main()
