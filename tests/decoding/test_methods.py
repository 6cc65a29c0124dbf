"""Each decoding method against a plain step-by-step re-implementation of its published algorithm."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from conftest import eos_biased_llm

from flash_dllm import SamplingParams
from flash_dllm.decoding import reference
from flash_dllm.decoding.block import block_sizes
from flash_dllm.decoding.reference import block_steps
from flash_dllm.decoding.sampling import NOISE_STREAM, REMASK_STREAM, counter_uniform
from flash_dllm.decoding.transfer import transfer_top_k

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples.", "x = 5\nprint(x)", "The passkey is"]


@pytest.fixture(scope="module")
def llm(mha_checkpoint):
    return eos_biased_llm(mha_checkpoint)


def proportional_steps(max_tokens: int, block_length: int, steps: int) -> list[int]:
    """Each block's steps, written apart from the engine's rule: step s (of `steps`) belongs to the block that
    holds the canvas position at the fraction (s + 1) / steps of max_tokens (rounded up), so that each block's
    share follows its length."""
    num_blocks = math.ceil(max_tokens / block_length)
    counts = [0] * num_blocks
    for s in range(steps):
        position = math.ceil(Fraction((s + 1) * max_tokens, steps)) - 1
        counts[position // block_length] += 1
    return counts


def llada_generate(model, prompt: list[int], params: SamplingParams, mask_id: int) -> list[int]:
    """LLaDA's reference `generate` (batch 1), written as published: per-block linear schedule, full
    forward every step, top-k over confidences; Gumbel noise from the engine's counter-based stream. A shorter
    last block gets its proportional share of the steps (`proportional_steps`)."""
    P, G, bl = len(prompt), params.max_tokens, params.block_length
    x = torch.full((1, P + G), mask_id, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    prompt_index = x != mask_id
    shares = proportional_steps(G, bl, params.settings.steps or G)
    seed, step = torch.tensor([params.seed]), 0
    for block, steps in enumerate(shares):
        start, end = P + block * bl, min(P + (block + 1) * bl, P + G)
        num_masked = (x[:, start:end] == mask_id).sum(dim=1, keepdim=True)
        num_transfer = (num_masked // steps).repeat(1, steps)
        num_transfer[:, :int(num_masked % steps)] += 1
        for i in range(steps):
            mask_index = x == mask_id
            if params.settings.cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                logits, un_logits = model(torch.cat([x, un_x])).chunk(2)
                logits = un_logits + (params.settings.cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x)
            logits = logits.double()
            if params.temperature > 0:
                columns = torch.arange(-P, G)[None]
                u = counter_uniform(seed, torch.tensor([step]), columns, NOISE_STREAM, logits.shape[-1])
                scores = logits.exp() / (-torch.log(u)) ** params.temperature
            else:
                scores = logits.clone()
            scores[..., mask_id] = -float("inf")  # the engine never decodes a position to the mask token
            x0 = torch.argmax(scores, dim=-1)
            if params.settings.remasking == "random":
                x0_p = counter_uniform(seed, torch.tensor([step]), torch.arange(-P, G)[None], REMASK_STREAM)
            else:
                x0_p = torch.gather(torch.softmax(logits, dim=-1), -1, x0[..., None]).squeeze(-1)
            x0_p[:, end:] = -float("inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -float("inf"))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            _, select = torch.topk(confidence[0], k=int(num_transfer[0, i]))
            transfer[0, select] = True
            x[transfer] = x0[transfer]
            step += 1
    return x[0, P:].tolist()


def fast_dllm_generate(model, prompt: list[int], params: SamplingParams, mask_id: int) -> list[int]:
    """Fast-dLLM's confidence-aware decoding (batch 1, no cache): per block, until it has no mask, unmask
    the top-1 plus every position at or above the threshold, or (factor) the rule's prefix."""
    P, G, bl = len(prompt), params.max_tokens, params.block_length
    x = torch.full((1, P + G), mask_id, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    for block in range(params.num_blocks):
        end = min(P + (block + 1) * bl, P + G)
        while (x[:, P + block * bl:end] == mask_id).any():
            mask_index = x == mask_id
            mask_index[:, end:] = False
            logits = model(x).double()
            x0 = logits.index_fill(-1, torch.tensor([mask_id]), -float("inf")).argmax(dim=-1)
            p = torch.gather(torch.softmax(logits, dim=-1), -1, x0[..., None]).squeeze(-1)
            confidence = torch.where(mask_index, p, -float("inf"))[0]
            order = torch.argsort(confidence, descending=True)
            if params.settings.factor is None:
                chosen = [order[0].item()] + [j.item() for j in order[1:] if confidence[j] >= params.settings.threshold]
            else:
                count = 1
                for n in range(1, int(mask_index.sum()) + 1):
                    if (n + 1) * (1 - confidence[order[n - 1]]) >= params.settings.factor:
                        break
                    count = n
                chosen = order[:count].tolist()
            x[0, chosen] = x0[0, chosen]
    return x[0, P:].tolist()


def cut_at_stop(tokens: list[int], stop_ids) -> list[int]:
    stops = [i for i, t in enumerate(tokens) if t in stop_ids]
    return tokens[:stops[0]] if stops else tokens


REFERENCE_CASES = [
    dict(max_tokens=32, block_length=8),                                  # one token per step
    dict(max_tokens=32, block_length=8, steps=12),                        # uneven linear schedule
    dict(max_tokens=24, block_length=24, steps=8, temperature=0.8, seed=7),
    dict(max_tokens=16, block_length=8, steps=8, remasking="random", seed=3),
    dict(max_tokens=16, block_length=8, steps=16, cfg_scale=1.5),
    dict(max_tokens=20, block_length=8),                                  # ragged: blocks of 8, 8 and 4
    dict(max_tokens=20, block_length=8, steps=7, temperature=0.8, seed=2),
    dict(max_tokens=6, block_length=8, steps=4, remasking="random", seed=5),  # one block, shorter than 8
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_reference_matches_llada_sampler(llm, case):
    params = SamplingParams(method="reference", **case)
    for prompt in PROMPTS[:3]:
        ids = llm.encode(prompt)
        expected = cut_at_stop(llada_generate(llm.model, ids, params, llm.special.mask_id), llm.special.stop_ids)
        out = llm.generate([ids], params)[0]
        assert out.token_ids == expected
        assert out.nfe == out.steps * (2 if params.settings.cfg_scale > 0 else 1)


@pytest.mark.parametrize("max_tokens, block_length", [(20, 8), (32, 8), (17, 8), (5, 8), (100, 32)])
def test_block_steps_share_the_steps_by_the_blocks_lengths(max_tokens, block_length):
    def params(steps):
        return SamplingParams(method="reference", max_tokens=max_tokens, block_length=block_length, steps=steps)
    num_blocks = math.ceil(max_tokens / block_length)
    blocks = torch.arange(num_blocks)
    lengths = [min(block_length, max_tokens - b * block_length) for b in range(num_blocks)]
    assert block_sizes(params(num_blocks), blocks).tolist() == lengths
    for steps in range(num_blocks, 2 * max_tokens + 1):
        shares = block_steps(params(steps), blocks).tolist()
        assert shares == proportional_steps(max_tokens, block_length, steps)
        assert sum(shares) == steps and min(shares) >= 1
        assert all(abs(share - Fraction(steps * n, max_tokens)) < 1 for share, n in zip(shares, lengths))
    assert block_steps(params(max_tokens), blocks).tolist() == lengths  # one token per step
    if max_tokens % block_length == 0:                                  # LLaDA's rule: steps / num_blocks each
        for steps in range(num_blocks, 4 * num_blocks + 1, num_blocks):
            assert block_steps(params(steps), blocks).tolist() == [steps // num_blocks] * num_blocks
    with pytest.raises(ValueError, match="at least the number of blocks"):
        params(num_blocks - 1) if num_blocks > 1 else params(0)


@pytest.mark.parametrize("steps", [7, 3])
def test_reference_unmasks_the_linear_schedule_of_each_blocks_share(llm, monkeypatch, steps):
    """Tokens per step on a ragged canvas (blocks of 8, 8 and 4): each block's length spread by LLaDA's linear
    schedule over its share of the steps (7: 2, 3 and 2 steps; 3: one each). One token per step is
    test_reference_matches_llada_sampler's ragged case."""
    decoded = []

    def recording(confidence, masked, k):
        transfer = transfer_top_k(confidence, masked, k)
        decoded.append(int(transfer.sum()))
        return transfer
    monkeypatch.setattr(reference, "transfer_top_k", recording)
    expected = []
    for block, share in enumerate(proportional_steps(20, 8, steps)):
        length = min(8, 20 - block * 8)
        expected += [length // share + (i < length % share) for i in range(share)]
    params = SamplingParams(method="reference", max_tokens=20, block_length=8, steps=steps)
    for prompt in PROMPTS:  # until one runs every step (the eos-biased model stops some early)
        decoded.clear()
        out = llm.generate([llm.encode(prompt)], params)[0]
        assert decoded == expected[:out.steps]
        if out.steps == len(expected):
            break
    else:
        pytest.fail("no request ran every step")


PARALLEL_CASES = [dict(threshold=0.6), dict(threshold=0.95), dict(factor=1.0),
                  dict(max_tokens=20, threshold=0.6), dict(max_tokens=20, factor=1.0)]  # ragged: blocks of 8, 8, 4


@pytest.mark.parametrize("case", PARALLEL_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_parallel_matches_fast_dllm(llm, case):
    params = SamplingParams(method="parallel", **{"max_tokens": 32, "block_length": 8, **case})
    for prompt in PROMPTS:
        ids = llm.encode(prompt)
        expected = cut_at_stop(fast_dllm_generate(llm.model, ids, params, llm.special.mask_id), llm.special.stop_ids)
        assert llm.generate([ids], params)[0].token_ids == expected


def test_parallel_threshold_one_is_one_token_per_step_reference(llm):
    parallel = SamplingParams(method="parallel", max_tokens=32, block_length=8, threshold=1.0)
    reference = SamplingParams(method="reference", max_tokens=32, block_length=8, steps=32)
    for a, b in zip(llm.generate(PROMPTS, parallel), llm.generate(PROMPTS, reference)):
        assert a.token_ids == b.token_ids
        assert a.steps == b.steps


def test_early_stop_cuts_at_first_stop_token(llm):
    outs = llm.generate(PROMPTS, SamplingParams(method="reference", max_tokens=64, block_length=16))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "the eos-biased model should stop some requests early"
    for out in outs:
        assert not set(out.token_ids) & set(llm.special.stop_ids)
    # A stopped request takes fewer steps than the 64 a full decode needs.
    assert all(o.steps < 64 for o in stopped)
