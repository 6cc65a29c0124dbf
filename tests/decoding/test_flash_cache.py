"""Flash-Cache: exact with a budget covering every position, fixed-size query sets otherwise, tracking
that puts the window first and newly decoded tokens next."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import eos_biased_llm

from flash_dllm import SamplingParams
from flash_dllm.decoding.flash_cache import FlashCacheState, query_priority

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many?", "x", "The passkey is 48213."]


@pytest.fixture(scope="module")
def llm(gqa_checkpoint):
    return eos_biased_llm(gqa_checkpoint, max_batch_size=3)


@pytest.mark.parametrize("rule", [dict(threshold=0.7), dict(factor=1.0), dict(threshold=0.7, max_tokens=12)],
                         ids=["threshold", "factor", "ragged"])  # ragged: blocks of 8 and 4
def test_budget_covering_everything_equals_no_cache(llm, rule):
    common = {"max_tokens": 32, "block_length": 8, **rule}
    full = SamplingParams(method="flash-cache", tracking_budget=200, mask_window=32, **common)
    plain = SamplingParams(method="parallel", **common)
    for a, b in zip(llm.generate(PROMPTS, full), llm.generate(PROMPTS, plain)):
        assert a.token_ids == b.token_ids and a.steps == b.steps


@pytest.mark.parametrize("max_tokens", [32, 20])
def test_fixed_size_query_sets_and_batching(llm, max_tokens):
    params = SamplingParams(method="flash-cache", max_tokens=max_tokens, block_length=8, threshold=0.7,
                            tracking_budget=6, mask_window=8, temperature=0.5, seed=4)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        length = len(out.prompt_token_ids) + max_tokens
        assert out.query_rows == length + (out.steps - 1) * min(14, length)  # one full pass, then 6 + 8


def test_priority_window_then_newly_decoded_then_attention():
    M = 9  # mask id
    tokens = torch.tensor([[0, 5, 6, 7, 8, 5, M, M, M, M]])  # prompt of 3, generated region of 7
    state = FlashCacheState(key_mass=torch.tensor([[0.0, 0.1, 0.9, 0.2, 0.3, 0.0, 0, 0, 0, 0]]),
                            decoded_at=torch.tensor([[-1, -1, -1, 0, 1, 1, -1, -1, -1, -1]]))
    batch = SimpleNamespace(tokens=tokens, attention_mask=torch.tensor([[False] + [True] * 9]), gen_start=3,
                            mask_id=M, params=SamplingParams(method="flash-cache", block_length=2, mask_window=3),
                            state=state, counters=SimpleNamespace(steps=torch.tensor([2])))
    order = query_priority(batch).argsort(dim=1, descending=True)[0].tolist()
    assert order[:3] == [6, 7, 8]           # the window: the three leftmost masks
    assert sorted(order[3:5]) == [4, 5]     # decoded in the last step (step 1)
    assert order[5:8] == [2, 3, 1]          # then by attention mass
    assert order[8] == 9 and order[9] == 0  # the mask beyond the window; padding last
