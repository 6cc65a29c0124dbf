"""Task generators are deterministic, test sets are held out, checkers read `#### value`."""
from __future__ import annotations

import random

import pytest

from flash_dllm.tasks import RETRIEVAL_TASKS, TASKS, Item, extract_answer, generate, is_correct, load_test_set


@pytest.mark.parametrize("task", TASKS)
def test_generators_are_seeded_and_consistent(task):
    a = [generate(task, random.Random(f"s{i}")) for i in range(50)]
    b = [generate(task, random.Random(f"s{i}")) for i in range(50)]
    assert a == b
    for item in a:
        assert extract_answer(item.solution) == item.answer
        assert is_correct(item, item.solution)


LENGTHS = {"passkey": {256, 512, 1024, 1536, 1900, 2048, 4096, 8000}, "multikey": {512, 1024, 2048, 4096, 8000}}


@pytest.mark.parametrize("task", TASKS)
def test_test_sets(task):
    items = load_test_set(task)
    assert len(items) >= 500
    assert len({item.prompt for item in items}) == len(items)
    assert all(is_correct(item, item.solution) for item in items)
    if task in RETRIEVAL_TASKS:
        assert {item.length for item in items} == LENGTHS[task]
        assert all(sum(item.length == length for item in items) >= 100 for length in LENGTHS[task])


def test_multikey_asks_for_one_of_several_labelled_keys():
    for item in load_test_set("multikey")[:50]:
        label = item.prompt.rsplit("What is the ", 1)[1].split(" door key?")[0]
        assert f"The {label} door key is {item.answer}." in item.prompt
        assert item.prompt.count(" door key is ") >= 2  # the others are distractors of the same form


def test_trace_answers_are_what_python_prints():
    """The worked trace's value is what the program really prints."""
    for item in load_test_set("trace")[:100]:
        program = item.prompt.split("\n", 1)[1]
        printed = []
        exec(program, {"print": lambda value: printed.append(value), "range": range})
        assert str(printed[0]) == item.answer


@pytest.mark.parametrize("output, expected", [
    ("so 3 + 4 = 7. #### 7", "7"), ("#### 1,234", "1234"), ("#### -5", "-5"), ("#### 12 #### 13", "13"),
    ("no answer here", None), ("####", None), ("#### 2.50", "2.50"),
])
def test_extract_answer(output, expected):
    assert extract_answer(output) == expected


def test_is_correct_numeric_and_passkey():
    arith = Item("arith", "q", "s", "12")
    assert is_correct(arith, "#### 12.0") and is_correct(arith, "#### 12") and not is_correct(arith, "#### 13")
    passkey = Item("passkey", "q", "s", "04213")
    assert is_correct(passkey, "#### 04213") and not is_correct(passkey, "#### 4213")


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        load_test_set("chess")
