"""The lm-eval model `flash_dllm` on a tiny checkpoint: Instances in, batched generation, stop strings applied."""
from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from flash_dllm import LLM, SamplingParams
from flash_dllm.eval.lm_eval_adapter import FlashDLLM

CONTEXTS = ["Tom has 3 apples and buys 4 more.", "The passkey is 48213.", "x = 5\nfor i in range(3):"]


@pytest.fixture(scope="module")
def lm(mha_checkpoint):
    return get_model("flash_dllm").create_from_arg_string(
        f"pretrained={mha_checkpoint},method=parallel,max_tokens=16,block_length=8,threshold=0.9,dtype=float32",
        {"batch_size": 2, "max_batch_size": None, "device": "cpu"})


def test_registered_under_its_name():
    assert get_model("flash_dllm") is FlashDLLM and get_model("flash-dllm") is FlashDLLM


def test_generate_until_matches_the_engine_with_stops(lm, mha_checkpoint):
    assert lm.params == SamplingParams(method="parallel", max_tokens=16, block_length=8, threshold=0.9)
    reference = LLM(str(mha_checkpoint), device="cpu", dtype="float32", chat_template=False)
    full = [out.text for out in reference.generate(CONTEXTS, lm.params)]
    stop = full[0][3:5]  # occurs in the first output: it must be cut there
    requests = [Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 256}), idx=i)
                for i, context in enumerate(CONTEXTS)]
    texts = lm.generate_until(requests, disable_tqdm=True)
    assert texts[0] == full[0][:full[0].find(stop)]
    assert texts == [text[:text.find(stop)] if stop in text else text for text in full]
    assert lm.generate_until([], disable_tqdm=True) == []


def test_chat_template_and_unsupported_requests(lm):
    prompt = lm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and lm.chat_template(True)
    with pytest.raises(NotImplementedError, match="loglikelihood .* not supported"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("a", " b"), idx=0)])
    with pytest.raises(NotImplementedError, match="not supported"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("a",), idx=0)])


def test_unknown_model_args(mha_checkpoint):
    with pytest.raises(ValueError, match="unknown model_args temprature"):
        FlashDLLM(pretrained=str(mha_checkpoint), temprature=0.5)
