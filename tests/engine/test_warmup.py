"""The kernel warm-up runs each kind of cached pass once per row count, once per model and process."""
from __future__ import annotations

import torch

from flash_dllm import LLM
from flash_dllm.cache import KVCache
from flash_dllm.engine.warmup import compile_kernels


def test_compile_kernels_runs_every_pass_kind_once_per_model(gqa_checkpoint):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(gqa_checkpoint, device=device, dtype="float32", kernels=True, cuda_graphs=False)
    cfg, model = llm.config, llm.model
    cache = KVCache.from_budget(cfg, 16 * KVCache.bytes_per_row(cfg, torch.float32), torch.float32, device)
    passes = []
    forward_cached = model.forward_cached
    model.forward_cached = lambda ids, positions, metadata, cache, key_mass=None, kernels=False: passes.append(
        (metadata.num_seqs, metadata.max_q, metadata.max_kv, metadata.write_cache, key_mass is not None)) or \
        forward_cached(ids, positions, metadata, cache, key_mass, kernels)
    compile_kernels(model, cache, row_counts=(1, 3, 32), request_counts=(1, 2))  # 32 rows do not fit: skipped
    kinds = [(True, False), (True, True), (False, False)]
    # over as many keys as rows, and over the most the cache holds (LONG_KV is more): the split-key variants
    assert passes == [(requests, rows, kv, *kind) for rows in (1, 3) for requests in (1, 2) for kv in (rows, 16)
                      for kind in kinds]
    compile_kernels(model, cache, row_counts=(1, 3))
    assert len(passes) == 24
