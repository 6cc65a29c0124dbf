"""Dream's sampler (`diffusion_generate`) as the method "dream": token-exact against a plain re-implementation of
the published loop for one sequence, on a tiny Dream checkpoint (shifted logits) and on the LLaDA one
(unshifted); batched == alone; counter-based sampling reproducible per seed; the reveal count from each row's
own masked count (the published code takes the batch's mean); range errors; the CLI flags."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_shifted import PROMPTS, dream_checkpoint

from flash_dllm import LLM, SamplingParams
from flash_dllm.batch import Counters, DecodeBatch, RowState
from flash_dllm.cli import main
from flash_dllm.decoding import diffusion_generate
from flash_dllm.decoding.diffusion_generate import filtered_logits
from flash_dllm.decoding.registry import method_of

G = 16


def well_conditioned(llm: LLM) -> LLM:
    """The LM head scaled up (clear margins between tokens and between positions' confidences) and the mask
    token's row zeroed (the published code could pick it; the engine never does)."""
    with torch.no_grad():
        head = llm.model.lm_head.weight
        head *= 3.0
        head[llm.special.mask_id] = 0.0
    return llm


@pytest.fixture(scope="module")
def dream(tmp_path_factory) -> LLM:
    llm = LLM(str(dream_checkpoint(tmp_path_factory.mktemp("dream"))), device="cpu", dtype="float32")
    assert llm.model.logit_shift == 1
    return well_conditioned(llm)


@pytest.fixture(scope="module")
def llada(mha_checkpoint) -> LLM:
    llm = LLM(str(mha_checkpoint), device="cpu", dtype="float32")
    assert llm.model.logit_shift == 0
    return well_conditioned(llm)


# ------------------------------------------------------------------ the published loop, one sequence, greedy

def top_p_logits(logits, top_p):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_indices_to_remove = cumulative_probs > top_p
    sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
    sorted_indices_to_remove[..., 0] = 0
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_indices, sorted_indices_to_remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits, top_k):
    indices_to_remove = logits < torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
    return logits.masked_fill(indices_to_remove, torch.finfo(logits.dtype).min)


def dream_generate(model, prompt: list[int], max_tokens: int, steps: int, alg: str, mask_id: int,
                   eps: float = 1e-3, top_p: float | None = None, top_k: int | None = None) -> list[int]:
    """Dream's `diffusion_generate` (`_sample`) for one sequence with temperature 0 and alg_temp 0, written as
    published. `model(x)` returns the logits already shifted for a shifted architecture (row j from hidden
    state j - 1: `torch.cat([logits[:, :1], logits[:, :-1]], 1)`). It checks that the case is well conditioned:
    no argmax and no top-k cut closer than 1e-6."""
    x = torch.tensor([prompt + [mask_id] * max_tokens])
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        logits = model(x).double()
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if top_p is not None and top_p < 1:
            mask_logits = top_p_logits(mask_logits, top_p)
        if top_k is not None:
            mask_logits = top_k_logits(mask_logits, top_k)
        probs = torch.softmax(mask_logits, dim=-1)
        confidence, x0 = probs.max(dim=-1)
        top2 = torch.sort(probs, dim=-1, descending=True).values[:, :2]
        assert (top2[:, 0] - top2[:, 1] > 1e-6).all() and (x0 != mask_id).all()
        if alg == "topk_margin":
            confidence = top2[:, 0] - top2[:, 1]
        elif alg == "entropy":
            confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if number_transfer_tokens > 0:
            ordered = torch.sort(full_confidence[0], descending=True).values
            if number_transfer_tokens < int(mask_index.sum()):
                assert ordered[number_transfer_tokens - 1] - ordered[number_transfer_tokens] > 1e-6
            _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
            x_ = torch.zeros_like(x) + mask_id
            x_[mask_index] = x0.clone()
            row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
            x[row_indices, transfer_index] = x_[row_indices, transfer_index]
    assert not (x == mask_id).any()
    return x[0, len(prompt):].tolist()


def cut_at_stop(tokens: list[int], stop_ids) -> list[int]:
    stops = [i for i, t in enumerate(tokens) if t in stop_ids]
    return tokens[:stops[0]] if stops else tokens


CASES = [dict(alg=alg, steps=steps) for alg in ("maskgit_plus", "topk_margin", "entropy") for steps in (G, G // 4)]
# top_k changes the confidences (top_p, which can leave one token and so tie confidences at 1, is checked on
# the filter itself: test_filters_match_published_top_p_and_top_k)
CASES += [dict(alg="entropy", steps=G // 2, top_k=3), dict(alg="maskgit_plus", steps=G // 4, top_k=2)]


@pytest.mark.parametrize("model", ["dream", "llada"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_published_diffusion_generate(request, model, case):
    llm = request.getfixturevalue(model)
    params = SamplingParams(method="dream", max_tokens=G, **case)
    outputs = llm.generate(PROMPTS, params)
    reference = {key: case[key] for key in ("top_p", "top_k") if key in case}
    for prompt, out in zip(PROMPTS, outputs):
        expected = dream_generate(llm.model, prompt, G, case["steps"], case["alg"], llm.special.mask_id,
                                  **reference)
        assert out.error is None
        assert out.token_ids == cut_at_stop(expected, llm.special.stop_ids)
        assert out.nfe == out.steps <= case["steps"]


@pytest.mark.parametrize("top_p, top_k", [(0.9, 0), (1.0, 5), (0.8, 3), (0.5, 400)])
def test_filters_match_published_top_p_and_top_k(top_p, top_k):
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    temperature = torch.tensor([0.0, 0.7, 1.3], dtype=torch.float64)
    ours = filtered_logits(logits, temperature, top_p, top_k)
    for row, t in enumerate(temperature.tolist()):
        expected = logits[row] / t if t > 0 else logits[row]
        if top_p < 1:
            expected = top_p_logits(expected, top_p)
        if top_k > 0:
            expected = top_k_logits(expected, top_k)
        kept = expected > torch.finfo(expected.dtype).min
        assert torch.equal(ours[row].isfinite(), kept) and kept.sum(dim=-1).min() >= 1
        assert torch.equal(ours[row][kept], expected[kept])


@pytest.mark.parametrize("knobs", [dict(alg="entropy", steps=G // 4),
                                   dict(alg="origin", temperature=0.8, seed=3),
                                   dict(alg="maskgit_plus", steps=G // 2, temperature=0.7, alg_temp=0.5,
                                        top_p=0.95, top_k=30, seed=5)],
                         ids=["greedy-entropy", "origin-sampled", "alg_temp-sampled"])
def test_batched_equals_alone(dream, knobs):
    params = SamplingParams(method="dream", max_tokens=G, **knobs)
    batched = dream.generate(PROMPTS, params)  # prompts of 7, 3, 1 and 11 tokens: left padding
    for prompt, out in zip(PROMPTS, batched):
        alone = dream.generate([prompt], params)[0]
        assert out.error is None and len(out.token_ids) > 0
        assert out.token_ids == alone.token_ids and out.steps == alone.steps


@pytest.mark.parametrize("knobs", [dict(alg="entropy", steps=G // 4),
                                   dict(alg="maskgit_plus", temperature=0.7, alg_temp=0.5, top_p=0.95, seed=5)],
                         ids=["greedy-entropy", "sampled"])
def test_logits_in_chunks_of_columns_change_nothing(dream, knobs, monkeypatch):
    """The float64 logits are taken a few columns at a time (Dream's vocabulary would need tens of GB at once);
    one column per chunk gives the same tokens as one chunk for all."""
    params = SamplingParams(method="dream", max_tokens=G, **knobs)
    whole = dream.generate(PROMPTS, params)
    monkeypatch.setattr(diffusion_generate, "CHUNK_BYTES", 1)
    for a, b in zip(dream.generate(PROMPTS, params), whole):
        assert a.token_ids == b.token_ids and a.steps == b.steps


def test_origin_sampling_is_reproducible_per_seed(dream):
    def run(seed):
        return [out.token_ids for out in dream.generate(PROMPTS, SamplingParams(
            method="dream", max_tokens=G, alg="origin", temperature=1.0, seed=seed))]
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_origin_reveals_everything_by_the_last_step(dream):
    outs = dream.generate(PROMPTS, SamplingParams(method="dream", max_tokens=G, steps=3, alg="origin"))
    assert all(out.error is None and out.steps <= 3 for out in outs)
    assert all(len(out.token_ids) == G for out in outs if out.finish_reason == "length")


def test_reveal_count_uses_each_rows_own_masked_count(dream):
    """Two rows at different steps with different masked counts (16 and 6): each reveals int(m * (1 - s/t))
    of its own m (the published code's batch mean, 11, would give the first row 2, not 3)."""
    mask_id, steps = dream.special.mask_id, 4
    params = SamplingParams(method="dream", max_tokens=G, steps=steps, alg="entropy")
    first = torch.tensor([17, 250, 33] + [mask_id] * G)
    second = torch.tensor([200, 7] + [40 + j for j in range(G - 6)] + [mask_id] * 6)
    rows = []
    for tokens, step in ((first, 0), (second, 2)):
        counters = Counters.zeros("cpu")
        counters.steps += step
        rows.append(RowState(params=params, prompt_length=tokens.shape[0] - G, tokens=tokens, counters=counters,
                             state=None, cache_base=None))
    batch = DecodeBatch.build(rows, mask_id, torch.tensor(dream.special.stop_ids), dream.special.pad_id)
    before = (batch.tokens[:, batch.gen_start:] == mask_id).sum(dim=1)
    method_of("dream").step(dream.engine.runner, batch)
    after = (batch.tokens[:, batch.gen_start:] == mask_id).sum(dim=1)

    timesteps = torch.linspace(1, 1e-3, steps + 1)
    expected = [int(torch.tensor(float(m)) * (1 - timesteps[i + 1] / timesteps[i])) for m, i in ((16, 0), (6, 2))]
    mean = [int(torch.tensor(11.0) * (1 - timesteps[i + 1] / timesteps[i])) for i in (0, 2)]
    assert before.tolist() == [16, 6]
    assert (before - after).tolist() == expected == [3, 2] and mean != expected
    assert batch.counters.steps.tolist() == [1, 3] and batch.counters.nfe.tolist() == [1, 1]


@pytest.mark.parametrize("knobs, error", [
    (dict(eps=0.0), "eps must be in (0, 1), got 0.0"),
    (dict(eps=1.0), "eps must be in (0, 1), got 1.0"),
    (dict(steps=0), "steps must be >= 1, got 0"),
    (dict(alg_temp=-0.5), "alg_temp must be >= 0, got -0.5"),
    (dict(alg_temp=float("nan")), "alg_temp must be finite, got nan"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-1), "top_k must be >= 0 (0: off), got -1"),
    (dict(alg="greedy"), "alg must be one of ('origin', 'maskgit_plus', 'topk_margin', 'entropy'), got 'greedy'"),
])
def test_out_of_range_settings(knobs, error):
    with pytest.raises(ValueError) as raised:
        SamplingParams(method="dream", **knobs)
    assert str(raised.value) == error


def test_no_blocks_max_tokens_need_not_be_a_multiple_of_block_length():
    assert SamplingParams(method="dream", max_tokens=10, block_length=32).max_tokens == 10


def test_cli_flags_on_the_embedded_model(capsys):
    code = main(["generate", "Tom has 3 apples.", "--device", "cpu", "--method", "dream", "--alg", "entropy",
                 "--steps", "8", "--eps", "0.01", "--top-k", "50", "--max-tokens", "16", "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    [line] = [json.loads(line) for line in captured.out.splitlines()]
    assert "error" not in line and line["steps"] <= 8
