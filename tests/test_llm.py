"""The user-facing API: prompts of every kind, the embedded default model, and clear errors."""
from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.llm import PROGRESS_MIN_PROMPTS
from flash_dllm.decoding.flash_cache import FlashCacheSettings
from flash_dllm.decoding.parallel import ParallelSettings


@pytest.fixture(scope="module")
def llm(gqa_checkpoint):
    return LLM(str(gqa_checkpoint), device="cpu", dtype="float32")


def test_embedded_default_model_generates():
    llm = LLM(device="cpu")
    out = llm.generate("What is 3 + 4?", SamplingParams(max_tokens=16, block_length=8))[0]
    assert isinstance(out.text, str) and out.steps > 0 and out.nfe == out.steps
    assert llm.use_chat_template and llm.config.max_position >= 8192


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
    assert out.text == "" and len(out.token_ids) <= 8
    assert llm.generate("hello")[0].error == ("prompt 0: this model has no tokenizer (no tokenizer.json); give "
                                              "prompts as token-id lists")


def test_random_preset():
    llm = LLM("random:llada-tiny", device="cpu")
    assert llm.tokenizer is None and llm.config.vocab_size == 320
    assert len(llm.generate([[1, 2, 5]], SamplingParams(max_tokens=8, block_length=4))[0].token_ids) <= 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="greedy"), "unknown method 'greedy'"),
    (dict(max_tokens=0), "max_tokens must be positive"),
    (dict(max_tokens=-4), "max_tokens must be positive"),
    (dict(method="reference", max_tokens=30, block_length=8, steps=3), "at least the number of blocks \\(4 "),
    (dict(method="parallel", steps=8), "steps applies to method reference"),
    (dict(method="reference", threshold=0.9), "threshold applies to method parallel"),
    (dict(threshold=0.9, factor=1.0), "either threshold or factor"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(method="reference", remasking="sometimes"), "remasking must be one of"),
    (dict(method="flash-cache", settings=ParallelSettings()),
     "settings of method 'flash-cache' are FlashCacheSettings"),
    (dict(settings=ParallelSettings(), threshold=0.5), "either as `settings` or as keywords"),
    (dict(max_tokens="32"), "max_tokens must be an integer, got '32' \\(str\\)"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(threshold=float("nan")), "threshold must be finite"),
    (dict(threshold=-0.1), "threshold must be in \\[0, 1\\], got -0.1"),
    (dict(threshold=1.5), "threshold must be in \\[0, 1\\], got 1.5"),
    (dict(method="flash-cache", threshold=1.01), "threshold must be in \\[0, 1\\]"),
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
    with pytest.raises(ValueError, match="unknown setting 'typical_p'"):
        SamplingParams(typical_p=0.9)
    with pytest.raises(ValueError, match="top_p applies to method dream, not 'parallel'"):
        SamplingParams(top_p=0.9)


BAD_PROMPTS = [  # (prompt, its error after "prompt N: ")
    ("", "the prompt is empty"),
    ([], "the prompt is empty"),
    ([1, 2, 100000], "token id 100000 is outside the vocabulary of 320"),
    ([5] * 1014, "prompt of 1014 tokens \\+ max_tokens 16 exceeds the model's maximum sequence length of 1024"),
    (7, "a prompt is a string, a list of token ids or a list of .* messages, got int"),
    ([{"role": "user"}], "a prompt is a string, a list of token ids or a list of .* messages, got list"),
    ([1, True], "a prompt is a string, a list of token ids or a list of .* messages, got list"),
    ("bad \udcff", "the prompt is not valid UTF-8 text"),
]


def test_bad_prompts_fail_alone(llm, caplog):
    """Each bad prompt gets an error output naming it, logged once; the others decode as they would alone."""
    params = SamplingParams(max_tokens=16, block_length=8)
    prompts = ["fine", *(prompt for prompt, _ in BAD_PROMPTS), [0, 5, 6]]
    outs = llm.generate(prompts, params)
    assert [out.index for out in outs] == list(range(len(prompts)))
    for index, ((prompt, message), out) in enumerate(zip(BAD_PROMPTS, outs[1:-1]), 1):
        assert re.fullmatch(f"prompt {index}: {message}", out.error), out.error
        assert (out.finish_reason, out.request_id, out.text, out.token_ids) == ("error", None, "", [])
        assert out.prompt == prompt
    assert [record.getMessage() for record in caplog.records] == [out.error for out in outs[1:-1]]
    for index in (0, len(prompts) - 1):
        alone = llm.generate(prompts[index], params)[0]
        assert outs[index].error is None and outs[index].token_ids == alone.token_ids
    assert not llm.engine.has_unfinished()


def test_call_level_mistakes_raise(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams, got dict"):
        llm.generate(["a"], [dict(max_tokens=8)])
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM("random:llada-tiny", device="cpu", dtype="float8")


def test_on_output_receives_each_output_as_it_finishes(llm):
    """Failed prompts first, then in finish order (of two requests in one batch, the one that unmasks a
    whole block per step finishes first); the returned list is in prompt order."""
    params = [SamplingParams(max_tokens=32, block_length=8, threshold=threshold) for threshold in (1.0, 0.0, 0.0)]
    seen = []
    outs = llm.generate(["long", "short", ""], params, on_output=seen.append)
    assert [out.index for out in seen] == [2, 1, 0] and seen[0].finish_reason == "error"
    assert sorted(seen, key=lambda out: out.index) == outs


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_keeps_finished_outputs_and_aborts_the_rest(llm, monkeypatch, failure):
    params = SamplingParams(max_tokens=8, block_length=8, threshold=1.0)  # 8 steps a request
    seen, step = [], llm.engine.step
    calls = iter(range(100))

    def interrupted_step():
        if next(calls) == 10:  # the first request (alone in a batch of 1) finished at step 8
            raise failure()
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    monkeypatch.setattr(llm.engine.scheduler, "max_batch_size", 1)
    with pytest.raises(failure):
        llm.generate(["one", "two", "three"], params, on_output=seen.append)
    assert [out.index for out in seen] == [0] and seen[0].finish_reason == "length"
    assert not llm.engine.has_unfinished()
    monkeypatch.undo()
    assert llm.generate("again", params)[0].finish_reason == "length"


def test_progress_bar_by_default_for_long_calls(llm, capsys):
    params = SamplingParams(max_tokens=8, block_length=8)
    llm.generate(["a", "b"], params)
    assert "req" not in capsys.readouterr().err  # pytest's stderr is not a terminal
    llm.generate(["a"] * (PROGRESS_MIN_PROMPTS + 1), params)
    assert f"/{PROGRESS_MIN_PROMPTS + 1} [" in capsys.readouterr().err
    llm.generate(["a"] * (PROGRESS_MIN_PROMPTS + 1), params, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_bf16_runs(gqa_checkpoint):
    llm = LLM(str(gqa_checkpoint), device="cpu", dtype=torch.bfloat16)
    assert next(llm.model.parameters()).dtype == torch.bfloat16
    assert llm.generate("hi", SamplingParams(max_tokens=8, block_length=8))[0].steps > 0


@pytest.mark.parametrize("content, why", [("", "empty"), (" \n\t", "only whitespace")])
def test_a_blank_chat_message_fails_alone(content, why):
    llm = LLM(device="cpu", dtype="float32")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": content}]
    blank, fine = llm.generate([messages, "What is 3 + 4?"], SamplingParams(max_tokens=8, block_length=8),
                               use_tqdm=False)
    assert blank.finish_reason == "error" and blank.error == f"prompt 0: message 1: its content is {why}"
    assert fine.finish_reason != "error"
