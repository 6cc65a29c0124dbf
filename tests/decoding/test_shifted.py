"""The cached methods on an architecture with shifted logits (Dream: position j from the hidden state of column
j - 1). Each method's exactness test repeated on a tiny Dream checkpoint (full refresh == no cache, verification
that rejects everything == Flash-Cache), batched == alone, and the pieces that carry the shift: the left
neighbour that prefix and dual cache recompute without writing it, the window's logit sources that rank first in
Flash-Cache's query set, and Flash-Verify's predictor rows, which give each candidate its view's logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import EXACT
from test_elastic import window_rule_without_cache

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache import KVCache
from flash_dllm.cache.attention_metadata import AttentionMetadata
from flash_dllm.config import PRESETS
from flash_dllm.decoding.flash_verify import CONTEXT, DRAFT, MASK, PREDICT, FlashVerify, verify_visibility
from flash_dllm.decoding.registry import METHODS
from flash_dllm.models import random_model, save_checkpoint

# Token-id prompts of different lengths (the checkpoint has no tokenizer); vocab 320, mask 3, eos 1.
PROMPTS = [[17, 250, 33, 98, 5, 61, 140], [200, 7, 9], [44], [12, 300, 71, 8, 90, 150, 66, 23, 4, 101, 55]]


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


@pytest.mark.parametrize("method, rule", [(method, rule) for method in EXACT
                                          for rule in (dict(threshold=0.7), dict(factor=1.0))
                                          if method != "flash-verify" or "threshold" in rule])
def test_exact_settings_equal_the_uncached_decoding(llm, method, rule):
    """Full refresh == no cache; a budget over every position == no cache; verification that accepts nothing
    == Flash-Cache with the same budget."""
    settings, plain_settings = EXACT[method]
    common = dict(max_tokens=32, block_length=8, **rule)
    cached = llm.generate(PROMPTS, SamplingParams(method=method, **settings, **common))
    plain = llm.generate(PROMPTS, SamplingParams(**plain_settings, **common))
    assert any(out.finish_reason == "stop" for out in plain)  # early stops refill rows
    for a, b in zip(cached, plain):
        assert a.error is None and a.token_ids == b.token_ids and a.steps == b.steps


@pytest.mark.parametrize("setting", [dict(mask_window=8), dict(mask_window=4, temperature=0.6, seed=3)])
def test_elastic_refreshing_every_step_is_the_window_rule_without_cache(llm, setting):
    params = SamplingParams(method="elastic", max_tokens=32, threshold=0.7, drift_threshold=1.0, **setting)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        expected, steps = window_rule_without_cache(llm.model, prompt, params, llm.special.mask_id,
                                                    llm.special.stop_ids)
        assert out.token_ids == expected and out.steps == steps


BATCHED = {
    "prefix-cache": dict(block_length=8), "dual-cache": dict(block_length=8),
    "flash-cache": dict(block_length=8, tracking_budget=4, mask_window=8),
    "flash-verify": dict(block_length=8, tracking_budget=4, mask_window=8, verify_threshold=0.3),
    "elastic": dict(mask_window=6, drift_threshold=0.95),
}


@pytest.mark.parametrize("method", BATCHED)
def test_batched_equals_alone(llm, method):
    params = SamplingParams(method=method, max_tokens=32, threshold=0.7, temperature=0.7, seed=1, **BATCHED[method])
    batched = llm.generate(PROMPTS, params)
    assert all(out.error is None for out in batched) and sum(len(out.token_ids) for out in batched) > 0
    for prompt, out in zip(PROMPTS, batched):
        assert out.token_ids == llm.generate([prompt], params)[0].token_ids


def check_logit_sources(llm: LLM, monkeypatch) -> list[int]:
    """Make every cached pass assert that each masked block column's logits come from one of its rows; returns
    the masked columns checked, pass by pass."""
    runner, checked = llm.engine.runner, []
    logits = runner.logits

    def checked_logits(hidden, flat_of_column, columns):
        masked = llm.engine.batch.tokens.gather(1, columns) == llm.special.mask_id
        assert (runner.logit_rows(flat_of_column, columns) >= 0)[masked].all()
        checked.append(int(masked.sum()))
        return logits(hidden, flat_of_column, columns)

    monkeypatch.setattr(runner, "logits", checked_logits)
    return checked


@pytest.mark.parametrize("method", ["flash-cache", "flash-verify"])
def test_a_short_budget_still_queries_every_masks_logit_source(llm, method, monkeypatch):
    """No tracking budget: the window's left neighbours take rows ahead of the window, so every masked block
    column's logits come from a row of the draft pass."""
    checked = check_logit_sources(llm, monkeypatch)
    outs = llm.generate(PROMPTS, SamplingParams(method=method, max_tokens=32, block_length=8, threshold=0.9,
                                                tracking_budget=0, mask_window=8))
    assert all(out.error is None for out in outs) and sum(checked) > 0


@pytest.mark.parametrize("method, knobs", [("dual-cache", {}),
                                           ("flash-verify", dict(tracking_budget=0, mask_window=8))],
                         ids=["dual-cache", "flash-verify"])
def test_a_short_last_block_takes_every_masks_logits_from_the_pass(llm, method, knobs, monkeypatch):
    """Blocks of 4, 4 and 2: the last block's reuse steps (its 2 columns and their left neighbour) and its
    draft passes compute every masked column's logit source."""
    checked = check_logit_sources(llm, monkeypatch)
    outs = llm.generate(PROMPTS, SamplingParams(method=method, max_tokens=10, block_length=4, threshold=0.9,
                                                **knobs))
    assert all(out.error is None for out in outs) and sum(checked) > 0
    assert any(out.finish_reason == "length" for out in outs)  # some decoded the last block to its end


def test_predictor_rows_give_each_views_logits(tmp_path):
    """On one layer a row's output depends only on the tokens it sees, so the verify pass's predictor of candidate
    i must give exactly the logits of a full forward over view i (context, D drafted, candidates ranked before i
    drafted, the others masked), whatever its left neighbour is: context, D, an earlier or a later candidate."""
    config = {**PRESETS["dream-tiny"], "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = random_model(str(tmp_path), "cpu", torch.float32, seed=5, std=0.3)
    mask_id, generator = 3, torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 320, (1, 12), generator=generator)
    tokens[0, 7:] = mask_id                                     # column 6 decoded; the block is 6..11
    columns = torch.arange(6, 12)[None]
    drafts = torch.randint(4, 320, (1, 6), generator=generator)
    accept_now = torch.tensor([[False, True, False, False, False, False]])   # D = {7}
    s_columns = torch.tensor([[10, 8, 11, 9, 6, 7]])            # S by rank: 10, 8, 11, 9 (then non-candidates)
    s_valid = torch.tensor([[True] * 4 + [False] * 2])
    draft_ids, by_rank = drafts.gather(1, s_columns - 6), torch.arange(6)[None]
    sources, view_ids = FlashVerify.predictors(1, tokens, columns, accept_now, drafts, s_columns, s_valid,
                                               draft_ids, by_rank)
    assert sources[0, :4].tolist() == [9, 7, 10, 8]  # a later candidate, D, an earlier one, an earlier one

    cache = KVCache(model.config, 12, torch.float32, "cpu")
    full = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 12]), kv_start=torch.tensor([0]),
                             kv_len=torch.tensor([12]), slot_mapping=torch.arange(12), max_q=12, max_kv=12)
    model.forward_cached(tokens[0], torch.arange(12), full, cache)  # the draft pass's cache
    context = torch.arange(8)                                       # decoded columns and D
    context_ids = torch.where(torch.arange(12) == 7, drafts[0, 1], tokens[0])[:8]
    S = s_columns[0, :4]
    pass_columns = torch.cat([context, S, S, sources[0, :4]])
    ids = torch.cat([context_ids, draft_ids[0, :4], torch.full((4,), mask_id), view_ids[0, :4]])
    role = torch.tensor([[CONTEXT] * 8 + [DRAFT] * 4 + [MASK] * 4 + [PREDICT] * 4])
    rank = torch.cat([torch.zeros(8, dtype=torch.long), torch.arange(4).repeat(3)])[None]
    hidden_keys = torch.ones(1, 12, dtype=torch.bool)               # every column is in the pass
    verify = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 20]), kv_start=torch.tensor([0]),
                               kv_len=torch.tensor([12]), slot_mapping=pass_columns, max_q=20, max_kv=12,
                               write_cache=False, hidden_keys=hidden_keys,
                               self_visibility=verify_visibility(role, rank, torch.ones_like(role, dtype=torch.bool)))
    hidden = model.forward_cached(ids, pass_columns, verify, cache)
    for i, column in enumerate(S.tolist()):
        view = torch.cat([context_ids, tokens[0, 8:]]).clone()
        for j, other in enumerate(S.tolist()):
            view[other] = draft_ids[0, j] if j < i else mask_id
        expected = model(view[None])[0, column]
        got = model.compute_logits(hidden[16 + i])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model.compute_logits(hidden[12 + i]), expected, atol=1e-3)  # not the mask view


def test_a_method_that_does_not_handle_the_shift_is_refused(llm, monkeypatch):
    monkeypatch.setattr(METHODS["flash-cache"], "handles_logit_shift", False)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(method="flash-cache", max_tokens=16, block_length=8))
    assert out.finish_reason == "error" and "does not handle this model's shifted logits" in out.error


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
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
