"""Tile sizes of kernels/fp8_matmul.py on the GPU: each config at each of LLaDA-8B's projections and row counts,
against cuBLAS's FP8 GEMM (unit scales) and bf16 GEMM and the weight-read floor; the best config per shape last.
GPU times from CUDA graphs of 20 calls (bench.forward.graph_time_ms): the launches the engine's graphs do not pay.

    PYTHONPATH=src python benchmarks/fp8_gemm_configs.py
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton

from flash_dllm.bench.forward import graph_time_ms
from flash_dllm.bench.roofline import HBM_BYTES_PER_S
from flash_dllm.kernels.fp8 import FP8, quantize_rows_ref
from flash_dllm.kernels.fp8_matmul import fp8_gemm
from flash_dllm.markdown import markdown_table

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = [16, 32, 64, 144, 256]
CONFIGS = [dict(BLOCK_W=w, BLOCK_T=t, BLOCK_K=k, num_warps=warps, num_stages=stages)
           for w, t, k, warps, stages in itertools.product([32, 64, 128], [16, 32, 64], [128, 256], [4], [4, 6])]


def main():
    device = torch.device("cuda")
    one = torch.ones((), device=device)
    rows_out = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), ROWS):
        x = quantize_rows_ref(torch.randn(m, k, device=device)).values
        w = quantize_rows_ref(torch.randn(n, k, device=device)).values
        want = (x.float() @ w.float().T)
        time = lambda fn: graph_time_ms(fn, device)
        best = None
        for config in CONFIGS:
            if config["BLOCK_T"] > max(16, triton_next_pow2(m)):
                continue
            try:
                out = fp8_gemm(x, w, torch.bfloat16, config)
            except triton.runtime.errors.OutOfResources:  # too many stages of too large tiles for shared memory
                continue
            err = ((out.float() - want).norm() / want.norm()).item()
            assert err < 1e-2, (name, m, config, err)
            ms = time(lambda: fp8_gemm(x, w, torch.bfloat16, config))
            if best is None or ms < best[0]:
                best = (ms, config)
        cublas = time(lambda: torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16))
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        bf16 = time(lambda: F.linear(xb, wb))
        floor = n * k / HBM_BYTES_PER_S * 1e3
        c = best[1]
        rows_out.append((name, m, f"{best[0] * 1e3:.1f}", f"{cublas * 1e3:.1f}", f"{bf16 * 1e3:.1f}",
                         f"{floor * 1e3:.1f}", f"{cublas / best[0]:.2f}", f"{best[0] / floor:.2f}",
                         f"W{c['BLOCK_W']} T{c['BLOCK_T']} K{c['BLOCK_K']} s{c['num_stages']}"))
        print(" | ".join(map(str, rows_out[-1])), flush=True)
    print(markdown_table(("projection", "rows", "triton us", "cuBLAS fp8 us", "cuBLAS bf16 us", "floor us",
                          "x faster than cuBLAS fp8", "x floor", "best config"), rows_out))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
