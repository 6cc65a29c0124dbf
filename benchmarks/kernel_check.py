"""GPU check of the Triton kernels at LLaDA-8B size (d 4096, 32 heads, head_dim 128, bf16, random inputs):
errors against the PyTorch references, median times against the unfused path and torch SDPA
(Nx = baseline time / kernel time; the key-mass row's error is that of the mass).

    PYTHONPATH=src python benchmarks/kernel_check.py
"""
import statistics

import torch
import torch.nn.functional as F

from flash_dllm.cache.block_table import BlockTable, cu_seqlens
from flash_dllm.kernels.attention import ragged_attention_ref
from flash_dllm.kernels.flash_attention import flash_attention
from flash_dllm.kernels.fused_qkv_rope import fused_qkv_rope, fused_qkv_rope_ref, qkv_rope
from flash_dllm.models.llada import apply_rotary, rotary_cos_sin

D_MODEL, HEADS, HEAD_DIM, KV_LEN, THETA = 4096, 32, 128, 768, 500000.0


def errors(out, ref):
    """(norm-relative error, max |out - ref| / max |ref|); NaN fails."""
    out, ref = out.double(), ref.double()
    assert not out.isnan().any()
    return ((out - ref).norm() / ref.norm()).item(), ((out - ref).abs().max() / ref.abs().max()).item()


def median_ms(fn, warmup=10, iters=50):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def report(name, err, ms_kernel, baselines):
    against = "  ".join(f"{label} {ms:.3f} ms ({ms / ms_kernel:.2f}x)" for label, ms in baselines)
    print(f"{name:34s} rel {err[0]:.1e} max {err[1]:.1e} | kernel {ms_kernel:.3f} ms | {against}")


def check_fused(batch, rows):
    N = batch * rows
    x = torch.randn(N, D_MODEL, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(3 * D_MODEL, D_MODEL, device="cuda", dtype=torch.bfloat16) * D_MODEL ** -0.5
    positions = (torch.arange(rows, device="cuda") + KV_LEN - rows).repeat(batch)      # the sequence's tail
    slot_mapping = torch.arange(batch, device="cuda").repeat_interleave(rows) * KV_LEN + positions
    caches = [torch.zeros(batch * KV_LEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    args = lambda k, v: (x, weight, None, positions, slot_mapping, k, v, HEADS, THETA)
    q = fused_qkv_rope(*args(caches[0], caches[1]))
    q_ref = fused_qkv_rope_ref(*args(caches[2], caches[3]))
    pairs = [(q, q_ref)] + [(caches[i][slot_mapping], caches[i + 2][slot_mapping]) for i in (0, 1)]
    err = [max(e) for e in zip(*(errors(a, b) for a, b in pairs))]  # worst of q, k, v
    cos, sin = rotary_cos_sin(positions, HEAD_DIM, THETA)  # once per forward in the model

    def unfused():  # LLaDABlock.cached_attention's path: matmul, RoPE, cache scatter
        q_, k_, v_ = F.linear(x, weight).split(D_MODEL, dim=-1)
        q_ = apply_rotary(q_.view(N, HEADS, HEAD_DIM), cos, sin)
        caches[2][slot_mapping] = apply_rotary(k_.view(N, HEADS, HEAD_DIM), cos, sin)
        caches[3][slot_mapping] = v_.view(N, HEADS, HEAD_DIM)
        return q_

    baselines = [("unfused", median_ms(unfused)), ("cuBLAS matmul alone", median_ms(lambda: F.linear(x, weight)))]
    report(f"fused qkv+rope  B={batch} N={N}", err, median_ms(lambda: fused_qkv_rope(*args(caches[0], caches[1]))),
           baselines)
    q = qkv_rope(*args(caches[0], caches[1]))  # the model's entry: the fused kernel, or GEMM + epilogue
    pairs = [(q, q_ref)] + [(caches[i][slot_mapping], caches[i + 2][slot_mapping]) for i in (0, 1)]
    err = [max(e) for e in zip(*(errors(a, b) for a, b in pairs))]
    report(f"qkv_rope        B={batch} N={N}", err, median_ms(lambda: qkv_rope(*args(caches[0], caches[1]))),
           baselines)


def attention_inputs(batch, rows):
    """Random q [batch * rows, H, D], a cache of batch ranges of KV_LEN rows, and their block table (half
    the rows tracked)."""
    N = batch * rows
    q = torch.randn(N, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch * KV_LEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    table = BlockTable(cu_seqlens_q=cu_seqlens([rows] * batch, "cuda"),
                       kv_start=torch.arange(batch, device="cuda") * KV_LEN,
                       kv_len=torch.full((batch,), KV_LEN, device="cuda"),
                       slot_mapping=torch.zeros(N, dtype=torch.long, device="cuda"),  # unused: no cache write here
                       max_q=rows, max_kv=KV_LEN, track_rows=torch.rand(N, device="cuda") < 0.5)
    return q, k_cache, v_cache, table


def check_attention(batch, rows):
    q, k_cache, v_cache, table = attention_inputs(batch, rows)
    q4 = q.view(batch, rows, HEADS, HEAD_DIM).transpose(1, 2)
    k4, v4 = (c.view(batch, KV_LEN, HEADS, HEAD_DIM).transpose(1, 2) for c in (k_cache, v_cache))
    sdpa = ("SDPA dense", median_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4)))
    name = f"B={batch} rows={rows} kv={KV_LEN}"

    out = flash_attention(q, k_cache, v_cache, table)
    report(f"attention       {name}", errors(out, ragged_attention_ref(q, k_cache, v_cache, table)),
           median_ms(lambda: flash_attention(q, k_cache, v_cache, table)),
           [("reference", median_ms(lambda: ragged_attention_ref(q, k_cache, v_cache, table))), sdpa])

    masses = [torch.zeros(batch, KV_LEN, device="cuda") for _ in range(2)]
    out = flash_attention(q, k_cache, v_cache, table, key_mass=masses[0])
    ragged_attention_ref(q, k_cache, v_cache, table, key_mass=masses[1])
    report(f"+ key mass      {name}", errors(masses[0], masses[1]),
           median_ms(lambda: flash_attention(q, k_cache, v_cache, table, key_mass=masses[0])),
           [("reference", median_ms(lambda: ragged_attention_ref(q, k_cache, v_cache, table, key_mass=masses[1]))),
            sdpa])

    table.write_cache = False
    table.hidden_keys = torch.rand(batch, KV_LEN, device="cuda") < 0.1
    table.self_visibility = torch.rand(batch, rows, rows, device="cuda") < 0.5
    k_new, v_new = torch.randn_like(q), torch.randn_like(q)
    verify = lambda fn: fn(q, k_cache, v_cache, table, k_new=k_new, v_new=v_new)
    report(f"verify pass     {name}", errors(verify(flash_attention), verify(ragged_attention_ref)),
           median_ms(lambda: verify(flash_attention)),
           [("reference", median_ms(lambda: verify(ragged_attention_ref))), sdpa])


if __name__ == "__main__":
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; times are medians of 50 after warm-up")
    for batch in (1, 32):
        check_fused(batch, 128)
        check_attention(batch, 128)
