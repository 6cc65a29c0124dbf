"""Answer extraction and equivalence: numbers (GSM8K), LaTeX answers (MATH) and code blocks (HumanEval, MBPP)."""
from __future__ import annotations

import re
from fractions import Fraction

# A number as people write it: "-3", "1,234", "$5.00", "3/4", "−2" (a Unicode minus). Thousands separators
# only in groups of three, so a list "1,2,3" reads as three numbers, not 123.
_NUMBER = re.compile(r"(?P<sign>[-−])?\s?\$?\s?(?P<int>\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?P<dec>\.\d+)?"
                     r"(?:\s?/\s?(?P<den>\d+)(?![\d.]))?")
_FINAL_ANSWER = re.compile(r"final answer is:?\s*(.+?)(?:\.?\s*I hope it is correct|\.?\s*$)", re.I | re.M)


def truncate(text: str, stops: tuple[str, ...]) -> str:
    """The text before the first stop string."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def _value(match: re.Match) -> Fraction:
    value = Fraction(match["int"].replace(",", "") + (match["dec"] or ""))
    if match["den"] is not None and int(match["den"]) != 0:
        value /= int(match["den"])
    return -value if match["sign"] else value


def parse_number(text: str) -> Fraction | None:
    """The first number in a string, exactly (5.00 == 5, 3/4 == 0.75); None if there is none."""
    match = _NUMBER.search(text)
    return _value(match) if match else None


def extract_number(text: str) -> Fraction | None:
    """GSM8K's final answer: the number after the last `####`, else after the last "answer is", else the last
    number in the text."""
    lower = text.lower()
    for marker in ("####", "answer is"):
        at = lower.rfind(marker)
        if at >= 0 and (value := parse_number(text[at + len(marker):])) is not None:
            return value
    numbers = list(_NUMBER.finditer(text))
    return _value(numbers[-1]) if numbers else None


def format_number(value: Fraction | None) -> str | None:
    return None if value is None else str(value)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), with nested braces."""
    at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if at < 0:
        return None
    rest = text[at:].split("{", 1)
    if len(rest) < 2:
        return None
    depth, body = 1, rest[1]
    for i, char in enumerate(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return body[:i].strip()
    return None  # unbalanced: the generation was cut inside the box


def extract_math(text: str) -> str | None:
    """A MATH answer: the last \\boxed{...}, else the Minerva form "Final Answer: The final answer is $X$."."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    found = _FINAL_ANSWER.findall(text)
    return found[-1].strip().strip("$").strip() if found else None


def _normalize(answer: str) -> str:
    answer = re.sub(r"\\(?:left|right|!|,|;|:)|\s+|\$", "", answer)
    return answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")


def math_equal(prediction: str | None, gold: str) -> bool:
    """Whether two LaTeX answers are the same mathematical object (math-verify parses both into sympy:
    fractions, radicals, intervals, sets, equations; string equality alone misses 0.75 = \\frac34)."""
    if prediction is None:
        return False
    if _normalize(prediction) == _normalize(gold):
        return True
    from math_verify import parse, verify

    return verify(parse(f"${gold}$"), parse(f"${prediction}$"))


_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def extract_code(text: str) -> str:
    """The first fenced code block (an unterminated one runs to the end), else the text itself."""
    match = _FENCE.search(text)
    return match.group(1) if match else text
