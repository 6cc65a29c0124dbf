"""Answer extraction and equivalence on known right and wrong answers."""
from __future__ import annotations

from fractions import Fraction

import pytest

from flash_dllm.eval.benchmarks import get_benchmark
from flash_dllm.eval.scoring import (extract_code, extract_math, extract_number, last_boxed, math_equal, parse_number,
                                     truncate)


@pytest.mark.parametrize("text, value", [
    ("1,234", 1234), ("$5.00", 5), ("-3", -3), ("3/4", Fraction(3, 4)), ("0.75", Fraction(3, 4)),
    ("−12", -12), ("$ 1,000,000.50", Fraction(2000001, 2)), ("18.", 18), ("1,2,3", 1), ("12,3456", 12),
])
def test_parse_number_formats(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("output, value", [
    ("She makes 9 * 2 = $18 every day.\n#### 18", 18),
    ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars. The answer is $18.00.", 18),
    ("So the total is 1,234 apples and 5 pears in 2 boxes", 2),    # no marker: the last number
    ("#### 1,234\n\nQuestion: Tom has 3", 1234),                   # the marked one, not the later number
    ("The answer is -3 degrees.", -3),
    ("The answer is: 3/4 of the cake", Fraction(3, 4)),
    ("It costs $5.00 in all. #### 5", 5),
    ("I don't know", None),
])
def test_extract_number(output, value):
    assert extract_number(output) == value


def test_gsm8k_scorer_right_and_wrong():
    gsm8k = get_benchmark("gsm8k")
    doc = {"question": "q", "answer": "5 * 246.8 = 1234\n#### 1234"}
    outputs = ["Total: 1,234.\n#### 1,234", "#### 1234.00", "The answer is $1,234.", "#### 1243",
               "The answer is 1234\nQuestion: What is 2 + 2?\nAnswer: 4", "#### 123"]
    assert [v.correct for v in gsm8k.score([doc] * len(outputs), outputs, chat=False)] == \
        [True, True, True, False, True, False]


def test_last_boxed_nested_and_cut():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{\frac{1}{2") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize("output, answer", [
    (r"so the result is $\boxed{\dfrac{3}{4}}$.", r"\dfrac{3}{4}"),
    ("Final Answer: The final answer is $[2,5)$. I hope it is correct.", "[2,5)"),
    ("The final answer is 3.5", "3.5"),
    ("no answer here", None),
])
def test_extract_math(output, answer):
    assert extract_math(output) == answer


@pytest.mark.parametrize("prediction, gold", [
    ("0.75", r"\frac{3}{4}"), ("3/4", r"\frac34"), (r"\dfrac{3}{4}", r"\frac{3}{4}"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{\sqrt2}{2}"), ("[2, 5)", "[2,5)"), ("1 + x^2", "x^2+1"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)"), ("1,234", "1234"),
    ("-2/3", r"-\frac{2}{3}"),
])
def test_math_equal_right(prediction, gold):
    assert math_equal(prediction, gold)


@pytest.mark.parametrize("prediction, gold", [
    ("0.74", r"\frac{3}{4}"), ("(2,5)", "[2,5)"), ("x^2-1", "x^2+1"), ("5", "6"), (None, "1"),
    (r"\frac{2}{3}", r"-\frac{2}{3}"),
])
def test_math_equal_wrong(prediction, gold):
    assert not math_equal(prediction, gold)


def test_math500_scorer():
    math500 = get_benchmark("math500")
    doc = {"question": "q", "answer": r"\frac{1}{2}"}
    outputs = [r"Thus $\boxed{0.5}$.", "Final Answer: The final answer is $\\frac12$. I hope it is correct.",
               r"$\boxed{\frac{1}{3}}$", "I am not sure.", r"$\boxed{2}$ Problem: next $\boxed{\frac{1}{2}}$"]
    assert [v.correct for v in math500.score([doc] * len(outputs), outputs, chat=False)] == \
        [True, True, False, False, False]


def test_extract_code_and_truncate():
    assert extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n") == "x = 1\n"          # cut by the length limit: no closing fence
    assert extract_code("    return 1\n") == "    return 1\n"  # plain completion
    assert truncate("a\nb\n#### 3\nQuestion: c", ("Question:", "\n\n\n")) == "a\nb\n#### 3\n"
