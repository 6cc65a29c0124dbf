"""Tile-size search for the two Triton kernels at LLaDA-8B shapes on the GPU: every candidate
config is checked against the PyTorch reference, timed with triton.testing.do_bench, and the best per
shape is printed beside the baseline (cuBLAS matmul alone for the fused kernel, the current config).
The winners go into each kernel's launch_config by hand.

    PYTHONPATH=src python benchmarks/tune_kernels.py [--kernels attention --attention-cases 32:112:verify]
"""
import argparse
import dataclasses
import itertools

import torch
import triton
from triton.testing import do_bench

from flash_dllm.bench.kernels import attention_inputs, rel_err
from flash_dllm.kernels import flash_attention as attention_module
from flash_dllm.kernels import fused_qkv_rope as fused_module
from flash_dllm.kernels.attention import ragged_attention_ref
from flash_dllm.models.loader import random_config

CONFIG = random_config("llada-8b")
D_MODEL, HEADS, HEAD_DIM, KV_LEN, THETA = CONFIG.hidden_size, CONFIG.num_heads, CONFIG.head_dim, 768, CONFIG.rope_theta


def search(module, configs, run, reference):
    """Time `run` under each config (module.launch_config patched); -> [(ms, config)], fastest first."""
    original = module.launch_config
    results = []
    for config in configs:
        module.launch_config = lambda *a, c=config, **kw: dict(c)
        try:
            err = rel_err(run(), reference)
            ms = do_bench(run, warmup=10, rep=40) if err < 1e-2 else float("inf")
        except Exception as exc:  # out of shared memory and the like
            print(f"  {config}: {type(exc).__name__}")
            ms = float("inf")
        results.append((ms, config))
    module.launch_config = original
    return sorted(results, key=lambda r: r[0])


def tune_fused(N):
    x = torch.randn(N, D_MODEL, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(3 * D_MODEL, D_MODEL, device="cuda", dtype=torch.bfloat16) * D_MODEL ** -0.5
    positions = torch.randint(0, KV_LEN, (N,), device="cuda")
    slots = torch.randperm(N, device="cuda")
    k, v = (torch.zeros(N, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = (x, weight, None, positions, slots, k, v, HEADS, THETA)
    reference = fused_module.fused_qkv_rope_ref(*args)
    current = fused_module.launch_config(N, HEAD_DIM // 2)
    small = N <= 256
    space = ([max(16, triton.next_power_of_2(N))], [16, 32, 64], [64, 128]) if small else ([64, 128], [32, 64], [64])
    configs = [dict(BLOCK_N=bn, BLOCK_HALF=bh, BLOCK_K=bk, num_warps=w, num_stages=s)
               for bn, bh, bk, w, s in itertools.product(*space, [4, 8], [3, 4])]
    results = search(fused_module, [current] + configs,
                     lambda: fused_module.fused_qkv_rope(*args), reference)
    cublas = do_bench(lambda: torch.nn.functional.linear(x, weight), warmup=10, rep=40)
    floor = (weight.numel() * 2 + N * D_MODEL * 2 * 4) / 4.25e12 * 1e3
    flops = 2 * N * D_MODEL * 3 * D_MODEL / 787e12 * 1e3
    cur = next(ms for ms, c in results if c == current)
    print(f"fused N={N}: best {results[0][0]:.4f} ms {results[0][1]} | current {cur:.4f} | cuBLAS matmul "
          f"{cublas:.4f} | floor {max(floor, flops):.4f}")
    for ms, c in results[1:4]:
        print(f"    {ms:.4f} {c}")
    return ("fused", N, results[0][0], cur, cublas, max(floor, flops), results[0][1])


def tune_attention(batch, rows, mode):
    """mode: "plain", "mass" (key mass of every row) or "verify" (own keys under a visibility mask, hidden
    cache keys)."""
    q, k_cache, v_cache, metadata = attention_inputs(CONFIG, batch, rows, KV_LEN, torch.bfloat16, "cuda")
    mass = torch.zeros(batch, KV_LEN, device="cuda") if mode == "mass" else None
    extra = {}
    if mode == "verify":
        metadata = dataclasses.replace(metadata, write_cache=False,
                                    hidden_keys=torch.rand(batch, KV_LEN, device="cuda") < 0.1,
                                    self_visibility=torch.rand(batch, rows, rows, device="cuda") < 0.5)
        extra = dict(zip(("k_new", "v_new"), (torch.randn_like(q) for _ in range(2))))
    reference = ragged_attention_ref(q, k_cache, v_cache, metadata, **extra)
    current = attention_module.launch_config(rows, verify=mode == "verify", num_seqs=batch)
    configs = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
               for bm, bn, w, s in itertools.product([32, 64, 128], [32, 64, 128], [4, 8], [2, 3])
               if bm <= max(16, triton.next_power_of_2(rows)) and not (bm == 128 and (bn == 128 or w == 4))]

    def run():
        if mass is not None:
            mass.zero_()
        return attention_module.flash_attention(q, k_cache, v_cache, metadata, mass, **extra)
    results = search(attention_module, [current] + configs, run, reference)
    sdpa_q = q.view(batch, rows, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa_k = k_cache.view(batch, KV_LEN, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa_v = v_cache.view(batch, KV_LEN, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v), warmup=10, rep=40)
    cur = next(ms for ms, c in results if c == current)
    name = f"attention B={batch} q={rows} {mode}"
    print(f"{name}: best {results[0][0]:.4f} ms {results[0][1]} | current {cur:.4f} | SDPA {sdpa:.4f}")
    for ms, c in results[1:4]:
        print(f"    {ms:.4f} {c}")
    return (name, q.shape[0], results[0][0], cur, sdpa, float("nan"), results[0][1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", nargs="+", choices=["fused", "attention"], default=["fused", "attention"])
    ap.add_argument("--attention-cases", nargs="+", default=["1:32:plain", "1:144:mass", "32:144:mass", "32:32:plain",
                                                             "32:241:plain", "1:112:verify", "32:112:verify"],
                    help="batch:rows:mode, mode plain, mass or verify")
    args = ap.parse_args()
    rows = [tune_fused(N) for N in (32, 144, 1152, 4608)] if "fused" in args.kernels else []
    if "attention" in args.kernels:
        for case in args.attention_cases:
            batch, q, mode = case.split(":")
            rows.append(tune_attention(int(batch), int(q), mode))
    print("\n| kernel | rows | best ms | current ms | baseline ms (cuBLAS / SDPA) | floor ms | best config |")
    print("|---|---|---|---|---|---|---|")
    for name, N, best, cur, base, floor, config in rows:
        print(f"| {name} | {N} | {best:.4f} | {cur:.4f} | {base:.4f} | {floor:.4f} | {config} |")


if __name__ == "__main__":
    main()
