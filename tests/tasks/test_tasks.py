"""Task generators are deterministic, test sets are held out, checkers read `#### value`; a choice task's checker
accepts each of its right answers and no mix of them."""
from __future__ import annotations

import collections
import itertools
import random
import re
from importlib import resources

import pytest
from tokenizers import Tokenizer

from flash_dllm.tasks import (CHOICE_TASKS, RETRIEVAL_TASKS, TASKS, Item, answer_length, extract_answer, generate,
                              is_correct, load_test_set)


@pytest.mark.parametrize("task", TASKS)
def test_generators_are_seeded_and_consistent(task):
    a = [generate(task, random.Random(f"s{i}")) for i in range(50)]
    b = [generate(task, random.Random(f"s{i}")) for i in range(50)]
    assert a == b
    for item in a:
        assert extract_answer(item.solution, task) == item.answer
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


# Choice tasks: several right answers, each output read from the prompt alone (a regex of the test's own here).

def boxes(prompt: str) -> list[tuple[str, str]]:
    return re.findall(r"(\w+)'s box holds (\d+)\.", prompt)


def perm_words(prompt: str) -> list[str]:
    return prompt.split(": ", 1)[1].rstrip(".").split(", ")


def pick_lines(prompt: str) -> list[str]:
    return [line.split(". ", 1)[1] for line in prompt.splitlines()[1:]]


def accepts(item: Item, answer: str) -> bool:
    return is_correct(item, f"#### {answer}")


@pytest.mark.parametrize("task", CHOICE_TASKS)
def test_choice_solutions_are_valid(task):
    for i in range(500):
        item = generate(task, random.Random(f"v{i}"))
        assert is_correct(item, item.solution) and accepts(item, item.answer)
        assert not is_correct(item, item.answer)  # no ####, no answer


def test_pairs_accepts_every_box_and_no_mix():
    for i in range(50):
        item = generate("pairs", random.Random(f"p{i}"))
        found = boxes(item.prompt)
        assert 3 <= len(found) <= 6 and tuple(item.answer.split()) in found
        for name, value in found:
            assert is_correct(item, f"{name}'s box holds {value}. #### {name} {value}")
        for (name, _), (other_name, other_value) in itertools.product(found, found):
            assert accepts(item, f"{name} {other_value}") == (name == other_name)  # one box's name, another's number
        name, value = found[0]
        absent_name = next(n for n in ("Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Jack") if n not in item.prompt)
        assert not accepts(item, f"{absent_name} {value}") and not accepts(item, f"{name} 100")
        assert not accepts(item, name) and not accepts(item, value) and not accepts(item, f"{name} {value} {value}")


def test_perm_accepts_every_order_and_no_duplicate_omission_or_extra():
    for i in range(50):
        item = generate("perm", random.Random(f"q{i}"))
        words = perm_words(item.prompt)
        assert 3 <= len(words) <= 6 and sorted(item.answer.split()) == sorted(words)
        for order in itertools.islice(itertools.permutations(words), 30):
            assert accepts(item, " ".join(order))
        assert not accepts(item, " ".join([*words[:-1], words[0]]))  # a duplicate in place of the last word
        assert not accepts(item, " ".join(words[:-1]))  # an omission
        assert not accepts(item, " ".join([*words, words[0]]))  # a word twice, the others all there
        extra = next(w for w in ("sun", "sea", "sky", "river", "cat", "dog", "tree") if w not in words)
        assert not accepts(item, " ".join([*words, extra]))  # a word not asked for


def test_pick_accepts_every_line_and_no_mix_or_cut():
    for i in range(50):
        item = generate("pick", random.Random(f"k{i}"))
        lines = [line.split() for line in pick_lines(item.prompt)]
        assert len(lines) == 3 and all(len(line) == 12 for line in lines) and item.answer.split() in lines
        assert all(len(set(column)) == 3 for column in zip(*lines))  # the lines differ at every position
        for a, b in itertools.product(lines, lines):
            assert accepts(item, " ".join(a))
            if a != b:
                assert not accepts(item, " ".join(a[:6] + b[6:]))  # halves of two lines
                assert not accepts(item, " ".join(a[:1] + b[1:]))
        assert not accepts(item, " ".join(lines[0][:11])) and not accepts(item, " ".join(lines[0] + lines[0][:1]))


def chosen_position(item: Item) -> tuple[int, int]:
    """(number of right answers' parts, which the solution chose): the box, the line, or where the prompt's first
    word went."""
    if item.task == "pairs":
        found = boxes(item.prompt)
        return len(found), found.index(tuple(item.answer.split()))
    if item.task == "perm":
        words = perm_words(item.prompt)
        return len(words), item.answer.split().index(words[0])
    return 3, pick_lines(item.prompt).index(item.answer)


@pytest.mark.parametrize("task", CHOICE_TASKS)
def test_choice_solutions_are_spread_uniformly(task):
    """Training data must spread the marginals over the right answers: a chi-square over 3,000 items, loose."""
    counts = collections.Counter(chosen_position(generate(task, random.Random(f"u{i}"))) for i in range(3000))
    per_size = collections.Counter()
    for (size, _), n in counts.items():
        per_size[size] += n
    chi2 = sum((counts[size, at] - n / size) ** 2 / (n / size) for size, n in per_size.items() for at in range(size))
    dof = sum(size - 1 for size in per_size)
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)


@pytest.mark.parametrize("task", CHOICE_TASKS)
def test_choice_test_sets(task):
    items = load_test_set(task)
    assert len(items) == 500 and all(item.task == task for item in items)
    assert all(is_correct(item, item.solution) and accepts(item, item.answer) for item in items)
    tokenizer = Tokenizer.from_file(str(resources.files("flash_dllm") / "assets" / "default" / "tokenizer.json"))
    longest = max(len(tokenizer.encode(item.solution, add_special_tokens=False).ids) for item in items)
    assert longest < answer_length(task)  # room for <|eot_id|>


@pytest.mark.parametrize("output, expected", [
    ("Lucy's box holds 11. #### Lucy  11\n", "Lucy 11"), ("#### a #### sun sea", "sun sea"), ("####  ", None),
    ("sun sea", None),
])
def test_extract_choice_answer(output, expected):
    assert extract_answer(output, "perm") == expected
