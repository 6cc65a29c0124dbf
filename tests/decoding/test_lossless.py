"""Lossless draft-and-verify reproduces one-token-per-step `reference` exactly, in fewer passes."""
from __future__ import annotations

import pytest

from conftest import eos_biased_llm

from flash_dllm import LLM, SamplingParams
from flash_dllm.engine import model_runner
from flash_dllm.tasks import load_test_set

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many?", "x", "The passkey is 48213.",
           "for i in range(3): print(i)", "Zoe has 12 shells."]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return eos_biased_llm(checkpoint, max_batch_size=4)


@pytest.mark.parametrize("case", [dict(draft_length=1), dict(draft_length=4), dict(draft_length=8),
                                  dict(draft_length=4, temperature=0.8, seed=3),
                                  dict(draft_length=4, max_tokens=20),              # blocks of 8, 8 and 4
                                  dict(draft_length=8, max_tokens=6, temperature=0.8, seed=3)],  # one block of 6
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_equals_reference_on_random_models(llm, case):
    case = dict(case)  # the parameter's dict is shared by both checkpoints' runs
    common = dict(max_tokens=case.pop("max_tokens", 32), block_length=8, temperature=case.pop("temperature", 0.0),
                  seed=case.pop("seed", 0))
    reference = llm.generate(PROMPTS, SamplingParams(method="reference", **common))
    lossless = llm.generate(PROMPTS, SamplingParams(method="lossless", **common, **case))
    for a, b in zip(lossless, reference):
        assert a.token_ids == b.token_ids
        assert a.nfe <= b.nfe


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_equals_reference_with_its_states_in_groups(llm, monkeypatch, temperature):
    """The states' forward and decisions taken group by group (the runner's groups of sequences, here one or two
    states each; a request's states span groups): still the reference's tokens."""
    common = dict(max_tokens=32, block_length=8, temperature=temperature, seed=5)
    reference = llm.generate(PROMPTS, SamplingParams(method="reference", **common))
    monkeypatch.setattr(model_runner, "FULL_PASS_ROWS", 150)
    lossless = llm.generate(PROMPTS, SamplingParams(method="lossless", draft_length=4, **common))
    assert [o.token_ids for o in lossless] == [o.token_ids for o in reference]


def test_equals_reference_with_fewer_passes_on_the_embedded_model():
    llm = LLM(device="cpu")
    prompts = [load_test_set("arith")[0].prompt]  # its answer (56 tokens) stops in the second block: CI time
    reference = llm.generate(prompts, SamplingParams(method="reference", max_tokens=128, block_length=32))
    lossless = llm.generate(prompts, SamplingParams(method="lossless", max_tokens=128, block_length=32,
                                                    draft_length=3))
    assert [o.token_ids for o in lossless] == [o.token_ids for o in reference]
    assert sum(o.nfe for o in lossless) < 0.6 * sum(o.nfe for o in reference)
