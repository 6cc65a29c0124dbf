"""Scheduled flash attention with each request's keys in one program against split across programs (the
default picks the split count by `num_splits`), at LLaDA-8B's heads (32 x 128, bf16, H200), each timed as
50 launches replayed from one CUDA graph; with the key mass where a case says so. Also the relative
difference of the two outputs.

    PYTHONPATH=src python benchmarks/attention_splits.py
"""
from __future__ import annotations

import torch

from flash_dllm.cache.attention_metadata import AttentionMetadata, cu_seqlens
from flash_dllm.kernels.flash_attention import flash_attention, launch_config, num_splits
from gemm_rows import timed_us  # benchmarks/: the CUDA-graph timing the benchmarks share

HEADS, HEAD_DIM, REPLAYS = 32, 128, 50
# (requests, query rows per request, keys per request, key mass)
CASES = [(1, 144, 768, True), (1, 33, 768, False), (1, 128, 768, False), (1, 33, 8192, False),
         (1, 144, 8192, True), (1, 33, 32768, False), (1, 144, 32768, True), (8, 144, 8192, True),
         (32, 144, 768, True)]


def main():
    torch.manual_seed(0)
    print("| requests | q rows | keys | key mass | splits | one program us | split us | speed-up | KV floor us |"
          " rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for requests, rows, keys, mass in CASES:
        n = requests * rows
        q = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(requests * keys, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        table = AttentionMetadata(cu_seqlens_q=cu_seqlens([rows] * requests, "cuda"),
                                  kv_start=torch.arange(requests, device="cuda") * keys,
                                  kv_len=torch.full((requests,), keys, device="cuda"),
                                  slot_mapping=torch.zeros(n, dtype=torch.long, device="cuda"), max_q=rows,
                                  max_kv=keys, track_rows=torch.rand(n, device="cuda") < 0.5)
        key_mass = torch.zeros(requests, keys, device="cuda") if mass else None
        config = launch_config(rows, num_seqs=requests)
        splits = num_splits(requests * -(-rows // config["BLOCK_M"]) * HEADS, keys, config["BLOCK_N"], mass)
        one = timed_us(lambda: flash_attention(q, k, v, table, key_mass, splits=1), REPLAYS)
        split = timed_us(lambda: flash_attention(q, k, v, table, key_mass), REPLAYS)
        a, b = flash_attention(q, k, v, table, splits=1).double(), flash_attention(q, k, v, table).double()
        floor = 2 * requests * keys * HEADS * HEAD_DIM * 2 / 4.25e12 * 1e6
        print(f"| {requests} | {rows} | {keys} | {mass} | {splits} | {one:.1f} | {split:.1f} | {one / split:.2f}x | "
              f"{floor:.1f} | {((a - b).norm() / b.norm()).item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
