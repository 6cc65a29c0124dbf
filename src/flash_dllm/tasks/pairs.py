"""Labelled pairs: 3-6 people's boxes, each holding a two-digit number; the answer is any one box with its own
number.

A measuring stick for parallel decoding: every box is a right answer, so a model trained on the task spreads
the answer's label and value over the boxes, and filling both in one step can join one box's name to another's
number, which is never right (names and numbers are distinct, so such a mix names no box)."""
from __future__ import annotations

import random
import re

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ivy", "Noah", "Ella"]
QUESTION = "Name any one box and the number it holds."
_BOX = re.compile(r"(\w+)'s box holds (\d+)\.")


def make_item(rng: random.Random) -> tuple[str, str, str]:
    names = rng.sample(NAMES, rng.randint(3, 6))
    values = rng.sample(range(10, 100), len(names))
    prompt = " ".join(f"{name}'s box holds {value}." for name, value in zip(names, values)) + " " + QUESTION
    # Drawn uniformly among the boxes: training data must spread the answer's marginals over every right answer
    # (a fixed pick, say the first box, would teach one answer, and parallel decoding would never err on it).
    name, value = rng.choice(list(zip(names, values)))
    return prompt, f"{name}'s box holds {value}. #### {name} {value}", f"{name} {value}"


def is_valid(prompt: str, output: str) -> bool:
    """The words after the output's last `####` are one box's name and its own number."""
    _, marker, answer = output.rpartition("####")
    return bool(marker) and tuple(answer.split()) in _BOX.findall(prompt)
