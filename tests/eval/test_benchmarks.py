"""Prompts the way the field builds them: GSM8K 5-shot, MATH 4-shot, HumanEval 0-shot, MBPP 3-shot."""
from __future__ import annotations

import pytest

from flash_dllm.eval.benchmarks import get_benchmark


@pytest.mark.parametrize("task, num_shots, marker", [("gsm8k", 5, "Question: "), ("math500", 4, "Problem:\n"),
                                                     ("humaneval", 0, "def "), ("arith", 0, "?")])
def test_text_prompts(task, num_shots, marker):
    example = get_benchmark(task).examples(chat=False, limit=2)[1]
    assert example.index == 1 and isinstance(example.prompt, str)
    assert example.prompt.count(marker) >= num_shots + 1
    problem = example.doc.get("question") or example.doc["prompt"]
    assert example.prompt.rfind(problem) > len(example.prompt) - len(problem) - 20  # the problem comes last


def test_gsm8k_text_and_chat():
    gsm8k = get_benchmark("gsm8k")
    text = gsm8k.examples(chat=False, limit=1)[0]
    assert text.prompt.count("Question: ") == 6 and text.prompt.endswith("\nAnswer:")
    assert text.prompt.startswith("Question: There are 15 trees") and "#### 6\n\nQuestion: " in text.prompt
    assert text.target.endswith("#### 18")
    chat = gsm8k.examples(chat=True, limit=1)[0]
    assert [m["role"] for m in chat.prompt] == ["user", "assistant"] * 5 + ["user"]
    assert chat.prompt[1]["content"].endswith("#### 6") and chat.prompt[-1]["content"] == text.prompt.split("\n\n")[-1]


def test_math_and_mbpp_prompts(tmp_path):
    math500 = get_benchmark("math500").examples(chat=False, limit=1)[0]
    assert math500.prompt.count("Final Answer: The final answer is") == 4 and math500.prompt.endswith("\n\nSolution:")
    mbpp = get_benchmark("mbpp")
    prompt = mbpp.prompt({"text": "Write a function f.", "test_list": ["assert f() == 1"]}, chat=False)
    assert prompt.count("[BEGIN]\n") == 4 and prompt.count("[DONE]") == 3
    assert prompt.endswith("assert f() == 1\n[BEGIN]\n")


def test_humaneval_prompts():
    humaneval = get_benchmark("humaneval")
    base, chat = humaneval.examples(chat=False, limit=1)[0], humaneval.examples(chat=True, limit=1)[0]
    assert base.prompt == base.doc["prompt"]
    assert len(chat.prompt) == 1 and base.doc["prompt"] in chat.prompt[0]["content"]


def test_the_fields_generation_lengths():
    assert [get_benchmark(t).max_tokens for t in ("gsm8k", "math500", "humaneval", "mbpp", "arith")] == \
        [256, 512, 512, 512, 128]


def test_unknown_task_and_misplaced_data():
    with pytest.raises(ValueError, match="unknown task"):
        get_benchmark("mmlu")
    with pytest.raises(ValueError, match="applies to mbpp only"):
        get_benchmark("gsm8k").examples(chat=False, path="my.jsonl")
