"""Our scheduled flash attention against PyTorch's Flash-Attention varlen kernel on the KV cache's own layout (each
request's keys a range of the flat cache, gaps between ranges: `cum_seq_k` gives the starts, `seqused_k` the
lengths), at LLaDA-8B's heads (32 x 128, bf16), each timed as 50 launches replayed from one CUDA graph. Issue 15's
question: at batch 32 our kernel took 0.35-0.48 ms a layer where SDPA took 0.18-0.19; is a vendor kernel over the
cache layout (with our key-mass sweep from its log-sum-exp) the faster path for plain passes?

    PYTHONPATH=src:benchmarks python benchmarks/archive/attention_backends.py
"""
from __future__ import annotations

import torch

from flash_dllm.cache.attention_metadata import AttentionMetadata, cu_seqlens
from flash_dllm.kernels.attention import ragged_attention_ref
from flash_dllm.kernels.flash_attention import flash_attention
from gemm_rows import timed_us  # benchmarks/ (on PYTHONPATH): the CUDA-graph timing the benchmarks share

HEADS, HEAD_DIM, REPLAYS, GAP = 32, 128, 50, 96
# (requests, query rows per request, keys per request): Flash-Cache, Dual-Cache, Flash-Verify's draft and verify
# rows at batch 32 and 1, a long prompt
CASES = [(32, 144, 768), (32, 32, 768), (32, 241, 768), (32, 112, 768), (1, 144, 768), (1, 32, 768),
         (8, 64, 8192), (1, 144, 8192)]


def vendor_attention(q, k_cache, v_cache, table: AttentionMetadata):
    """Flash-Attention varlen over the cache ranges -> (out [N, H, D], log-sum-exp [H, N] natural log)."""
    starts = table.kv_start.to(torch.int32)
    cum_k = torch.cat([starts, (starts[-1:] + table.kv_len[-1:].to(torch.int32))])
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k_cache, v_cache, table.cu_seqlens_q.to(torch.int32), cum_k, table.max_q, table.max_kv, 0.0, False,
        False, scale=HEAD_DIM ** -0.5, seqused_k=table.kv_len.to(torch.int32))
    return out, lse


def main():
    torch.manual_seed(0)
    print(torch.__version__, torch.ops.aten._flash_attention_forward.default._schema)
    print("| requests | q rows | keys | ours us | ours + key mass us | vendor us | ours / vendor | vendor rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for requests, rows, keys in CASES:
        n = requests * rows
        q = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(requests * (keys + GAP), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        table = AttentionMetadata(cu_seqlens_q=cu_seqlens([rows] * requests, "cuda"),
                                  kv_start=torch.arange(requests, device="cuda") * (keys + GAP),
                                  kv_len=torch.full((requests,), keys, device="cuda"),
                                  slot_mapping=torch.zeros(n, dtype=torch.long, device="cuda"), max_q=rows,
                                  max_kv=keys, track_rows=torch.rand(n, device="cuda") < 0.5)
        mass = torch.zeros(requests, keys, device="cuda")
        ours = timed_us(lambda: flash_attention(q, k, v, table), REPLAYS)
        ours_mass = timed_us(lambda: flash_attention(q, k, v, table, mass), REPLAYS)
        try:
            vendor = timed_us(lambda: vendor_attention(q, k, v, table), REPLAYS)
            reference = ragged_attention_ref(q.float(), k.float(), v.float(), table).double()
            out = vendor_attention(q, k, v, table)[0].double()
            err = f"{((out - reference).norm() / reference.norm()).item():.1e}"
        except RuntimeError as error:  # the kernel's limits on this build
            vendor, err = float("nan"), str(error).splitlines()[0][:60]
        print(f"| {requests} | {rows} | {keys} | {ours:.1f} | {ours_mass:.1f} | {vendor:.1f} | {ours / vendor:.2f}x |"
              f" {err} |", flush=True)


if __name__ == "__main__":
    main()
