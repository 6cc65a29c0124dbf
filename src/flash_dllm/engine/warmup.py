"""Compile every Triton kernel variant of the cached passes when the KV cache is allocated, not mid-run.

Triton compiles a kernel at its first launch with each new set of compile-time constants, and the kernels
choose their tile sizes by row count. A step whose row count enters a new size class (a batch that shrinks
as its requests finish, a verify pass that grows) would otherwise compile in the middle of decoding, at
0.1-1 s a variant: measured on the H200, the first sweep points of a method ran 5-20x slow. One pass per
row-count class and pass kind compiles them all; Triton's disk cache then serves later processes.
"""
from __future__ import annotations

import itertools
import weakref

import torch

from ..cache.attention_metadata import AttentionMetadata, FlatRows
from ..cache.kv_cache import KVCache
from ..kernels.greedy_tokens import greedy_tokens

# One row count per tile-size class of the kernels' launch configurations (by total and per-request rows),
# each as one request and as several (the attention kernel's verify tiles depend on the batch too).
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REQUEST_COUNTS = (1, 8)
# Each pass also runs over this many keys (at most the cache's rows): few requests then split their keys across
# programs, variants of the attention kernel of their own (kernels/flash_attention.py, SPLIT_MIN_KEYS).
LONG_KV = 8192

# model -> the modes (batch-invariant or not) whose variants are compiled in this process
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def compile_kernels(model, cache: KVCache, row_counts: tuple[int, ...] = ROW_COUNTS,
                    request_counts: tuple[int, ...] = REQUEST_COUNTS, ordered: bool = False):
    """Run the three kinds of cached pass (cache write; with tracked rows; verify, which writes no cache)
    through the kernels for each number of requests and rows per request, over as many keys as rows and over
    LONG_KV, on the first cache rows (shared by the requests). ordered: the batch-invariant mode's variants.
    Then the greedy sampler once over the vocabulary.
    Call before any sequence holds cache rows."""
    if ordered in _compiled.get(model, ()):
        return
    device = cache.k[0].device
    zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=device)
    long_kv = min(cache.num_rows, LONG_KV)
    for rows, requests in itertools.product(row_counts, request_counts):
        if rows > cache.num_rows:
            continue
        n = rows * requests
        ids = zeros(n, dtype=torch.long)
        positions = torch.arange(rows, device=device).repeat(requests)
        for kv in sorted({rows, max(rows, long_kv)}):
            shape = lambda **options: AttentionMetadata.build(
                FlatRows.from_counts([rows] * requests, device), zeros(requests, dtype=torch.long),
                torch.full((requests,), kv, device=device), positions, kv, ordered=ordered, **options)
            model.forward_cached(ids, positions, shape(), cache, kernels=True)
            tracked = shape(track_rows=torch.ones(n, dtype=torch.bool, device=device))
            model.forward_cached(ids, positions, tracked, cache, key_mass=zeros(requests, kv), kernels=True)
            verify = shape(write_cache=False, hidden_keys=zeros(requests, kv, dtype=torch.bool),
                           self_visibility=torch.ones(requests, rows, rows, dtype=torch.bool, device=device))
            model.forward_cached(ids, positions, verify, cache, kernels=True)
    for dtype in {torch.float32, cache.k[0].dtype}:  # the sampler's: full passes' fp32 logits, cached passes' own
        greedy_tokens(zeros(1, model.config.vocab_size, dtype=dtype), mask_id=0)
    _compiled.setdefault(model, set()).add(ordered)
