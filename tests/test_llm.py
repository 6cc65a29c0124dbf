"""The user-facing API: prompts of every kind, the embedded default model, and clear errors."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.decoding.flash_cache import FlashCacheSettings
from flash_dllm.decoding.parallel import ParallelSettings


@pytest.fixture(scope="module")
def llm(gqa_checkpoint):
    return LLM(str(gqa_checkpoint), device="cpu", dtype="float32")


def test_embedded_default_model_generates():
    llm = LLM(device="cpu")
    out = llm.generate("What is 3 + 4?", SamplingParams(max_tokens=16, block_length=8))[0]
    assert isinstance(out.text, str) and out.steps > 0 and out.nfe == out.steps
    assert llm.use_chat_template and llm.config.max_position >= 2048


def test_prompt_kinds_agree(llm):
    """A string goes through the chat template; the same conversation as messages or as token ids
    decodes identically."""
    text = "Tom has 3 apples."
    ids = llm.encode(text)
    assert ids[0] == llm.config.bos_token_id
    assert llm.tokenizer.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    params = SamplingParams(max_tokens=16, block_length=8)
    outs = llm.generate([text, [{"role": "user", "content": text}], ids], params)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].prompt_token_ids == ids
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)


def test_raw_string_without_chat_template(gqa_checkpoint):
    llm = LLM(str(gqa_checkpoint), device="cpu", chat_template=False)
    assert llm.encode("Tom has 3 apples.") == llm.tokenizer.encode("Tom has 3 apples.")


def test_directory_without_tokenizer(tmp_path, gqa_checkpoint):
    path = tmp_path / "no_tokenizer"
    path.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors"):
        shutil.copy(gqa_checkpoint / name, path / name)
    llm = LLM(str(path), device="cpu")
    out = llm.generate([[0, 5, 6, 7]], SamplingParams(max_tokens=8, block_length=8))[0]
    assert out.text is None and len(out.token_ids) <= 8
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")


def test_random_preset():
    llm = LLM("random:llada-tiny", device="cpu")
    assert llm.tokenizer is None and llm.config.vocab_size == 320
    assert len(llm.generate([[1, 2, 5]], SamplingParams(max_tokens=8, block_length=4))[0].token_ids) <= 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="greedy"), "unknown method 'greedy'"),
    (dict(max_tokens=0), "max_tokens must be positive"),
    (dict(max_tokens=-4), "max_tokens must be positive"),
    (dict(max_tokens=30, block_length=8), "multiple of block_length"),
    (dict(method="reference", max_tokens=32, block_length=8, steps=6), "multiple of the number of blocks"),
    (dict(method="parallel", steps=8), "steps applies to method reference"),
    (dict(method="reference", threshold=0.9), "threshold applies to method parallel"),
    (dict(threshold=0.9, factor=1.0), "either threshold or factor"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(method="reference", remasking="sometimes"), "remasking must be one of"),
    (dict(method="flash-cache", settings=ParallelSettings()), "settings of method 'flash-cache' are FlashCacheSettings"),
    (dict(settings=ParallelSettings(), threshold=0.5), "either as `settings` or as keywords"),
    (dict(max_tokens="32"), "max_tokens must be an integer, got '32' \\(str\\)"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(threshold=float("nan")), "threshold must be finite"),
    (dict(threshold=-0.1), "threshold must be >= 0"),
    (dict(seed=2**64), "seed must be in \\[0, 2\\*\\*63\\)"),
    (dict(seed=-1), "seed must be in"),
    (dict(method="flash-cache", tracking_budget=1.5), "tracking_budget must be an integer"),
    (dict(method="flash-verify", verify_threshold=None), "verify_threshold must be given"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_settings_whole_or_as_keywords():
    whole = SamplingParams(method="flash-cache", settings=FlashCacheSettings(threshold=0.7, tracking_budget=40))
    assert whole == SamplingParams(method="flash-cache", threshold=0.7, tracking_budget=40)
    assert whole.settings.mask_window == 64 and whole.to_dict()["tracking_budget"] == 40
    assert dataclasses.replace(whole, max_tokens=64).settings is whole.settings


def test_unknown_parameter():
    with pytest.raises(ValueError, match="unknown setting 'top_p'"):
        SamplingParams(top_p=0.9)


def test_bad_requests_leave_the_engine_usable(llm):
    too_long = [5] * (llm.config.max_position - 10)
    with pytest.raises(ValueError, match="prompt 1: prompt of 1014 tokens .* exceeds the model's maximum sequence "
                                         "length of 1024"):
        llm.generate(["fine", too_long], SamplingParams(max_tokens=16, block_length=8))
    with pytest.raises(ValueError, match="prompt 0: token id 100000 is outside the vocabulary"):
        llm.generate([[1, 2, 100000]])
    for empty in ("", []):
        with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
            llm.generate(["fine", empty], SamplingParams(max_tokens=8, block_length=8))
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM("random:llada-tiny", device="cpu", dtype="float8")
    assert not llm.engine.has_unfinished()
    assert llm.generate("fine", SamplingParams(max_tokens=8, block_length=8))[0].steps > 0


def test_bf16_runs(gqa_checkpoint):
    llm = LLM(str(gqa_checkpoint), device="cpu", dtype=torch.bfloat16)
    assert next(llm.model.parameters()).dtype == torch.bfloat16
    assert llm.generate("hi", SamplingParams(max_tokens=8, block_length=8))[0].steps > 0
