"""Scheduled flash attention with each request's keys in one program against split across programs (the
default picks the split count by `num_splits`), at LLaDA-8B's heads (32 x 128, bf16, H200), each timed as
50 launches replayed from one CUDA graph; with the key mass where a case says so. Also the relative
difference of the two outputs. Routed cases read 1/8 of the keys (random 32-key chunks, through `routed_keys`)
and split as if there were no key mass: whether a routed Flash-Cache step (64 rows with the key mass, one row tile
per head: 32 programs at batch 1) should split below SPLIT_MIN_KEYS_WITH_MASS.

    PYTHONPATH=src:benchmarks python benchmarks/archive/attention_splits.py
"""
from __future__ import annotations

import torch

from flash_dllm.cache.attention_metadata import AttentionMetadata, cu_seqlens
from flash_dllm.kernels.flash_attention import flash_attention, launch_config, num_splits, routed_keys
from gemm_rows import timed_us  # benchmarks/ (on PYTHONPATH): the CUDA-graph timing the benchmarks share

HEADS, HEAD_DIM, REPLAYS = 32, 128, 50
# (requests, query rows per request, keys per request, key mass, routed)
CASES = [(1, 144, 768, True, False), (1, 33, 768, False, False), (1, 128, 768, False, False),
         (1, 33, 8192, False, False), (1, 144, 8192, True, False), (1, 33, 32768, False, False),
         (1, 144, 32768, True, False), (8, 144, 8192, True, False), (32, 144, 768, True, False),
         (1, 64, 8192, True, True), (8, 64, 8192, True, True), (1, 32, 8192, False, True)]


def main():
    torch.manual_seed(0)
    print("| requests | q rows | keys | key mass | routed | splits | one program us | split us | speed-up |"
          " KV floor us | rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for requests, rows, keys, mass, routed in CASES:
        n = requests * rows
        q = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(requests * keys, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        table = AttentionMetadata(cu_seqlens_q=cu_seqlens([rows] * requests, "cuda"),
                                  kv_start=torch.arange(requests, device="cuda") * keys,
                                  kv_len=torch.full((requests,), keys, device="cuda"),
                                  slot_mapping=torch.zeros(n, dtype=torch.long, device="cuda"), max_q=rows,
                                  max_kv=keys, track_rows=torch.rand(n, device="cuda") < 0.5)
        key_mass = torch.zeros(requests, keys, device="cuda") if mass else None
        route = {}
        if routed:
            opened = torch.rand(requests, HEADS, -(-keys // 32), device="cuda") < 0.125
            route = dict(routed=routed_keys(opened.repeat_interleave(32, dim=-1)[..., :keys], table.kv_len))
        config = launch_config(rows, num_seqs=requests, routed=routed)
        splits = num_splits(requests * -(-rows // config["BLOCK_M"]) * HEADS, keys, config["BLOCK_N"],
                            mass and not routed)
        one = timed_us(lambda: flash_attention(q, k, v, table, key_mass, splits=1, **route), REPLAYS)
        split = timed_us(lambda: flash_attention(q, k, v, table, key_mass, splits=splits, **route), REPLAYS)
        a = flash_attention(q, k, v, table, splits=1, **route).double()
        b = flash_attention(q, k, v, table, splits=splits, **route).double()
        floor = 2 * requests * keys * (0.125 if routed else 1) * HEADS * HEAD_DIM * 2 / 4.25e12 * 1e6
        print(f"| {requests} | {rows} | {keys} | {mass} | {routed} | {splits} | {one:.1f} | {split:.1f} | "
              f"{one / split:.2f}x | {floor:.1f} | {((a - b).norm() / b.norm()).item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
