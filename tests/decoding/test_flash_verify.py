"""Flash-Verify: the isolation mask of the verify pass, its acceptance, and its place among the methods."""
from __future__ import annotations

import pytest
import torch

from flash_dllm import LLM, SamplingParams, load_model
from flash_dllm.cache import KVCache
from flash_dllm.cache.attention_metadata import AttentionMetadata
from flash_dllm.decoding.flash_verify import CONTEXT, DRAFT, MASK, verify_visibility
from flash_dllm.tasks import is_correct, load_test_set

from conftest import eos_biased_llm, tiny_config, write_checkpoint

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many?", "x", "The passkey is 48213."]


def test_visibility_matrix():
    role = torch.tensor([[CONTEXT, DRAFT, DRAFT, MASK, MASK]])
    rank = torch.tensor([[0, 0, 1, 0, 1]])
    seen = verify_visibility(role, rank, torch.ones_like(role, dtype=torch.bool))[0].int().tolist()
    assert seen == [
        [1, 0, 0, 1, 1],  # context: context and mask views, never drafts
        [1, 1, 0, 0, 1],  # draft 0: drafts <= 0, masks > 0
        [1, 1, 1, 0, 0],  # draft 1: drafts <= 1, masks > 1
        [1, 0, 0, 1, 1],  # mask 0: drafts < 0, masks >= 0
        [1, 1, 0, 0, 1],  # mask 1: drafts < 1, masks >= 1
    ]


def verify_pass(model, cache, ids, drafts, mask_id):
    """A verify pass over one request: context positions 0-5, candidates at 9, 7, 8 (ranks 0, 1, 2)."""
    context, candidates = list(range(6)), [9, 7, 8]
    columns = context + candidates + candidates
    tokens = ids[context].tolist() + drafts + [mask_id] * 3
    role = torch.tensor([[CONTEXT] * 6 + [DRAFT] * 3 + [MASK] * 3])
    rank = torch.tensor([[0] * 6 + [0, 1, 2] * 2])
    valid = torch.ones_like(role, dtype=torch.bool)
    hidden_keys = torch.zeros(1, len(ids), dtype=torch.bool)
    hidden_keys[0, columns] = True
    table = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 12]), kv_start=torch.tensor([0]),
                              kv_len=torch.tensor([len(ids)]), slot_mapping=torch.tensor(columns), max_q=12,
                              max_kv=len(ids), write_cache=False, hidden_keys=hidden_keys,
                              self_visibility=verify_visibility(role, rank, valid))
    before = [k.clone() for k in cache.k]
    hidden = model.forward_cached(torch.tensor(tokens), torch.tensor(columns), table, cache)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k)), "the verify pass wrote the cache"
    return hidden


def test_changing_a_draft_changes_only_what_may_see_it(tmp_path):
    """On one layer, where a row's output depends only on the keys it sees. (Deeper, a draft reaches
    context and earlier mask rows through the mask views that see it: a property of the mask itself.)"""
    model = load_model(write_checkpoint(tmp_path, tiny_config(n_layers=1), with_tokenizer=False))
    mask_id = 3
    ids = torch.randint(4, model.config.vocab_size, (12,))
    ids[6:] = mask_id
    cache = KVCache(model.config, 12, torch.float32, "cpu")
    table = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 12]), kv_start=torch.tensor([0]), kv_len=torch.tensor([12]),
                       slot_mapping=torch.arange(12), max_q=12, max_kv=12)
    model.forward_cached(ids, torch.arange(12), table, cache)  # the draft pass's cache
    a = verify_pass(model, cache, ids, [20, 21, 22], mask_id)
    b = verify_pass(model, cache, ids, [20, 30, 22], mask_id)  # the rank-1 draft changes
    same = [torch.allclose(a[i], b[i], atol=0, rtol=0) for i in range(12)]
    assert all(same[:6]), "context rows saw a draft"
    assert same[6] and not same[7] and not same[8]           # drafts: rank 0 unaffected; ranks >= 1 see it
    assert same[9] and same[10] and not same[11]             # mask views at or before rank 1 unaffected


@pytest.fixture(scope="module")
def llm(gqa_checkpoint):
    return eos_biased_llm(gqa_checkpoint, max_batch_size=3)


@pytest.mark.parametrize("max_tokens", [32, 20])  # 20: blocks of 8, 8 and 4
def test_rejecting_every_candidate_is_flash_cache(llm, max_tokens):
    """With gamma = 1 nothing is verified in; the accepted tokens are the draft's, as in Flash-Cache."""
    common = dict(max_tokens=max_tokens, block_length=8, threshold=0.6, tracking_budget=10, mask_window=16)
    verify = llm.generate(PROMPTS, SamplingParams(method="flash-verify", verify_threshold=1.0, **common))
    cache = llm.generate(PROMPTS, SamplingParams(method="flash-cache", **common))
    for a, b in zip(verify, cache):
        assert a.token_ids == b.token_ids and a.steps == b.steps
        assert b.steps <= a.nfe <= 2 * a.steps  # a verify pass only where candidates remained


@pytest.mark.parametrize("acceptance, max_tokens", [("sequential", 32), ("cumprod", 32), ("sequential", 20)])
def test_batched_equals_alone(llm, acceptance, max_tokens):
    params = SamplingParams(method="flash-verify", max_tokens=max_tokens, block_length=8, threshold=0.9,
                            verify_threshold=0.3, acceptance=acceptance, tracking_budget=10, mask_window=16)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        assert out.token_ids == llm.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("acceptance", ["sequential", "cumprod"])
def test_verification_saves_iterations_on_the_embedded_model(acceptance):
    llm = LLM(device="cpu")
    items = load_test_set("arith")[:16]
    prompts = [item.prompt for item in items]
    results = {}
    for method, extra in (("flash-cache", {}), ("flash-verify", {"acceptance": acceptance})):
        outs = llm.generate(prompts, SamplingParams(method=method, max_tokens=128, **extra))
        results[method] = (sum(o.steps for o in outs), sum(is_correct(i, o.text) for i, o in zip(items, outs)))
    assert results["flash-verify"][0] < results["flash-cache"][0]  # fewer iterations (32 against 36 here)
    assert results["flash-verify"][1] >= results["flash-cache"][1] - 2     # about the same accuracy
