"""Fast-dLLM's prefix and dual caches: exact with a full refresh every step, close without, batched
like single requests, and bounded by the KV cache budget."""
from __future__ import annotations

import pytest

from conftest import eos_biased_llm

from flash_dllm import LLM, SamplingParams
from flash_dllm.tasks import is_correct, load_test_set

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many?", "x", "The passkey is 48213."]


@pytest.fixture(scope="module")
def llm(gqa_checkpoint):
    return eos_biased_llm(gqa_checkpoint, max_batch_size=3)


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
@pytest.mark.parametrize("rule", [dict(threshold=0.7), dict(factor=1.0), dict(threshold=0.7, max_tokens=12)],
                         ids=["threshold", "factor", "ragged"])  # ragged: blocks of 8 and 4
def test_full_refresh_equals_no_cache(llm, method, rule):
    """Recomputing everything every step through the cache gives parallel's tokens exactly, with
    prompts of different lengths sharing batches and rows refilled."""
    common = {"max_tokens": 32, "block_length": 8, **rule}
    cached = llm.generate(PROMPTS, SamplingParams(method=method, refresh_interval=1, **common))
    plain = llm.generate(PROMPTS, SamplingParams(method="parallel", **common))
    for a, b in zip(cached, plain):
        assert a.token_ids == b.token_ids and a.steps == b.steps


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
@pytest.mark.parametrize("max_tokens", [32, 20])
def test_batched_equals_alone(llm, method, max_tokens):
    params = SamplingParams(method=method, max_tokens=max_tokens, block_length=8, threshold=0.7, temperature=0.7,
                            seed=1)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        assert out.token_ids == llm.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
def test_reuse_steps_of_a_short_last_block(llm, method):
    """One token per step over blocks of 8, 8 and 4: each block's first step is a full pass, its later steps
    recompute the block (dual cache) or the block and what follows it (prefix cache)."""
    outs = llm.generate(PROMPTS, SamplingParams(method=method, max_tokens=20, block_length=8, threshold=1.0))
    complete = [out for out in outs if out.steps == 20]  # the eos-biased model stops some early
    assert complete
    reused = [8, 8, 4] if method == "dual-cache" else [20, 12, 4]
    for out in complete:
        length = len(out.prompt_token_ids) + 20
        assert out.query_rows == sum(length + (size - 1) * rows for size, rows in zip([8, 8, 4], reused))


def test_small_cache_queues_requests_and_refuses_what_never_fits(gqa_checkpoint):
    params = SamplingParams(method="dual-cache", max_tokens=32, block_length=8, threshold=0.7)
    big = LLM(str(gqa_checkpoint), device="cpu", max_batch_size=4)
    per_token = 2 * big.config.num_layers * big.config.num_kv_heads * big.config.head_dim * 4
    small = LLM(str(gqa_checkpoint), device="cpu", max_batch_size=4, kv_cache_bytes=120 * per_token)
    lengths = [len(small.encode(p)) + 32 for p in PROMPTS]
    assert max(lengths) <= 120 < sum(lengths)  # one at a time fits, all together do not
    for a, b in zip(small.generate(PROMPTS, params), big.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
    assert small.engine.allocator.num_free == 120
    too_long, fits = small.generate([[5] * 100, PROMPTS[0]], params)  # the one that never fits fails alone
    assert too_long.error == ("prompt 0: a sequence of 132 tokens can never fit in a KV cache of 120 tokens; "
                              "raise kv_cache_bytes or shorten the request")
    assert fits.token_ids == big.generate(PROMPTS[0], params)[0].token_ids
    assert not small.engine.has_unfinished()


def test_caches_keep_accuracy_on_the_embedded_model():
    llm = LLM(device="cpu")
    items = load_test_set("arith")[:16]
    accuracy = {}
    for method in ("parallel", "prefix-cache", "dual-cache"):
        outs = llm.generate([item.prompt for item in items], SamplingParams(method=method, max_tokens=128))
        accuracy[method] = sum(is_correct(item, out.text) for item, out in zip(items, outs))
    assert accuracy["prefix-cache"] >= accuracy["parallel"] - 2 and accuracy["dual-cache"] >= accuracy["parallel"] - 3
