"""The summaries of routed prompt chunks kept beside the KV cache (Triton), beside the PyTorch reference.

A chunk is CHUNK cache rows from a multiple of CHUNK (requests start at such rows, kv_cache.ALIGN); its summary
per KV head is the lower bounds, upper bounds and mean of its prompt keys (routing.summarise). A pass that writes
prompt keys rewrites the summaries of the chunks it wrote, after its keys are in the cache and before the
routing reads them; a pass that writes none (a step over the generated part only) costs one launch whose
programs return at once. Graph capturable: which rows write is read on the device. An fp8 cache's keys are
summarised dequantised (in fp32: each E4M3 key times its scale), the summaries kept in the model's dtype.
"""
from __future__ import annotations

import torch

from ..cache.routing import CHUNK, cached_keys, summarise

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


def write_chunk_summaries_ref(k_cache: torch.Tensor, summaries: torch.Tensor, chunk: torch.Tensor,
                              prompt_end: torch.Tensor, k_scale: torch.Tensor | None = None):
    """k_cache [rows, Hkv, D]; summaries [rows / CHUNK, 3, Hkv, D]; chunk, prompt_end [N]
    (PromptRouting.written_chunks): rewrite the summary of each chunk >= 0 from its cache rows below prompt_end
    (host syncs: the reference). k_scale [rows, Hkv] fp32: an fp8 cache's."""
    chunk, prompt_end = chunk[chunk >= 0], prompt_end[chunk >= 0]
    if chunk.numel() == 0:
        return
    rows = chunk[:, None] * CHUNK + torch.arange(CHUNK, device=chunk.device)
    member = rows < prompt_end[:, None]
    keys = cached_keys(k_cache, k_scale, rows.clamp(max=k_cache.shape[0] - 1))              # [n, CHUNK, Hkv, D]
    parts = summarise(keys, member)
    summaries[chunk] = torch.stack([parts[0], parts[1], parts[2]], dim=2)[:, 0].to(summaries.dtype)


def write_chunk_summaries(k_cache: torch.Tensor, summaries: torch.Tensor, chunk: torch.Tensor,
                          prompt_end: torch.Tensor, k_scale: torch.Tensor | None = None):
    """The Triton kernel of write_chunk_summaries_ref (same arguments, same result): one program per query row and
    KV head; of the rows of one chunk that follow each other, only the first writes it."""
    if triton is None:
        raise RuntimeError("write_chunk_summaries needs triton; use write_chunk_summaries_ref")
    N, (Hkv, D) = chunk.shape[0], k_cache.shape[1:]
    if N == 0:
        return
    assert k_cache.stride(-1) == summaries.stride(-1) == 1
    assert k_scale is None or k_scale.stride(-1) == 1
    _chunk_summaries_kernel[(N, Hkv)](
        k_cache, k_scale if k_scale is not None else k_cache, summaries, chunk, prompt_end, k_cache.shape[0],
        k_cache.stride(0), k_cache.stride(1), k_scale.stride(0) if k_scale is not None else 0, summaries.stride(0),
        summaries.stride(1), summaries.stride(2), D, CHUNK=CHUNK, KV_FP8=k_scale is not None,
        BLOCK_D=max(16, triton.next_power_of_2(D)))


if triton is not None:
    @triton.jit
    def _chunk_summaries_kernel(k_ptr, ks_ptr, s_ptr, chunk_ptr, end_ptr, num_rows, stride_kn, stride_kh, stride_ksn,
                                stride_sc, stride_sk, stride_sh, D, CHUNK: tl.constexpr, KV_FP8: tl.constexpr,
                                BLOCK_D: tl.constexpr):
        row, kv_head = tl.program_id(0), tl.program_id(1)
        chunk = tl.load(chunk_ptr + row)
        before = tl.load(chunk_ptr + tl.maximum(row - 1, 0))
        if (chunk < 0) | ((row > 0) & (before == chunk)):
            return
        o_n, o_d = chunk * CHUNK + tl.arange(0, CHUNK), tl.arange(0, BLOCK_D)
        m_n = (o_n < tl.load(end_ptr + row)) & (o_n < num_rows)
        m_d = o_d < D
        b_k = tl.load(k_ptr + o_n[:, None].to(tl.int64) * stride_kn + kv_head * stride_kh + o_d[None, :],
                      mask=m_n[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        if KV_FP8:  # dequantised: each E4M3 key times its scale
            b_k *= tl.load(ks_ptr + o_n.to(tl.int64) * stride_ksn + kv_head, mask=m_n, other=0.0)[:, None]
        count = tl.sum(m_n.to(tl.float32), 0)
        lower = tl.min(tl.where(m_n[:, None], b_k, float("inf")), 0)
        upper = tl.max(tl.where(m_n[:, None], b_k, float("-inf")), 0)
        mean = tl.sum(b_k, 0) / tl.maximum(count, 1.0)
        p_s = s_ptr + chunk.to(tl.int64) * stride_sc + kv_head * stride_sh + o_d
        dtype = s_ptr.dtype.element_ty
        tl.store(p_s, lower.to(dtype), mask=m_d)
        tl.store(p_s + stride_sk, upper.to(dtype), mask=m_d)
        tl.store(p_s + 2 * stride_sk, mean.to(dtype), mask=m_d)
