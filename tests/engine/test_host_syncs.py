"""A steady-state step synchronises with the host once (the engine's read of the finished rows), twice for
Flash-Verify (its verify pass's shape) (GPU only: torch's sync debug mode)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache import KVCache
from flash_dllm.engine.llm_engine import LLMEngine
from flash_dllm.engine.model_runner import ModelRunner

SYNCS_PER_STEP = {"prefix-cache": 1, "dual-cache": 1, "flash-cache": 1, "flash-verify": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations")
@pytest.mark.parametrize("method", SYNCS_PER_STEP)
def test_host_syncs_per_step(gqa_checkpoint, method):
    llm = LLM(gqa_checkpoint, device="cuda", dtype="float32", kernels=True)
    knobs = dict(tracking_budget=4, mask_window=8) if method.startswith("flash") else {}
    params = SamplingParams(method=method, max_tokens=64, block_length=8, threshold=1.0,  # one token a step
                            **knobs)
    row_bytes = KVCache.bytes_per_row(llm.config, torch.float32)
    runner = ModelRunner(llm.model, kernels=True, cuda_graphs=True, kv_cache_bytes=2 * 80 * row_bytes)
    engine = LLMEngine(runner, dataclasses.replace(llm.special, stop_ids=()), 2)
    for prompt in ([5, 9, 13, 7], [11, 4, 6, 8, 12, 3]):
        engine.add_request(prompt, params)
    for _ in range(6):  # the first full pass, and graph captures
        engine.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):  # inside one block: no refresh step
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 3 * SYNCS_PER_STEP[method], [str(w.message)[:200] for w in syncs]
