"""The cached methods on an architecture with shifted logits (Dream: position j from the hidden state of column
j - 1): a step that reuses the cache also recomputes the column before the block, without writing its K/V.
Exact with a full refresh every step, batched like single requests, and the cache left as it was there."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.config import PRESETS
from flash_dllm.models import random_model, save_checkpoint

# Token-id prompts of different lengths (the checkpoint has no tokenizer); vocab 320, mask 3, eos 1.
PROMPTS = [[17, 250, 33, 98, 5, 61, 140], [200, 7, 9], [44], [12, 300, 71, 8, 90, 150, 66, 23, 4, 101, 55]]
METHODS = ["prefix-cache", "dual-cache"]


def dream_checkpoint(path: Path, seed: int = 0, std: float = 0.3) -> Path:
    """A tiny Dream-format checkpoint (sharded, GQA, random q/k/v biases) with weights large enough that
    confidences are far from flat."""
    model = random_model("dream-tiny", "cpu", torch.float32, seed=seed, std=std)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    save_checkpoint(model, path, PRESETS["dream-tiny"], num_shards=2)
    return path


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    """Its eos logit scaled up, so that some requests stop early and rows are refilled."""
    llm = LLM(str(dream_checkpoint(tmp_path_factory.mktemp("dream"))), device="cpu", dtype="float32",
              max_batch_size=3)
    assert llm.model.logit_shift == 1
    llm.model.lm_head.weight[llm.special.stop_ids[0]] *= 2.5
    return llm


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rule", [dict(threshold=0.7), dict(factor=1.0)])
def test_full_refresh_equals_no_cache(llm, method, rule):
    cached = llm.generate(PROMPTS, SamplingParams(method=method, max_tokens=32, block_length=8,
                                                  refresh_interval=1, **rule))
    plain = llm.generate(PROMPTS, SamplingParams(method="parallel", max_tokens=32, block_length=8, **rule))
    assert any(out.finish_reason == "stop" for out in plain)  # early stops refill rows
    for a, b in zip(cached, plain):
        assert a.error is None and a.token_ids == b.token_ids and a.steps == b.steps


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_alone(llm, method):
    params = SamplingParams(method=method, max_tokens=32, block_length=8, threshold=0.7, temperature=0.7, seed=1)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        assert out.error is None and len(out.token_ids) > 0
        assert out.token_ids == llm.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("method", METHODS)
def test_reuse_steps_recompute_the_left_neighbour_without_writing_it(llm, method, monkeypatch):
    """A request whose step reuses the cache has one extra row, its first: the column before the block, whose
    K/V go to the scratch row, so the pass leaves the cache at that position unchanged (a refreshing request
    in the same pass has none)."""
    runner, seen = llm.engine.runner, []
    run = runner.run

    def checked_run(p, key_mass=None):
        kept = p.metadata.slot_mapping == runner.cache.scratch_row
        slots = (p.metadata.kv_start[p.rows.request] + p.positions)[kept]
        before = [(k[slots].clone(), v[slots].clone()) for k, v in zip(runner.cache.k, runner.cache.v)]
        hidden = run(p, key_mass)
        if kept.any():
            seen.append(int(kept.sum()))
            groups = p.rows.request[kept]
            assert (p.rows.rank[kept] == 0).all() and groups.unique().numel() == groups.numel()  # a group's first
            for (k0, v0), k, v in zip(before, runner.cache.k, runner.cache.v):
                assert torch.equal(k[slots], k0) and torch.equal(v[slots], v0)
        return hidden

    monkeypatch.setattr(runner, "run", checked_run)
    outs = llm.generate(PROMPTS, SamplingParams(method=method, max_tokens=32, block_length=8, threshold=0.95))
    assert all(out.error is None for out in outs) and seen
