"""Permutations: 3-6 distinct words to write in any order, each exactly once.

A measuring stick for parallel decoding: every order is a right answer, so a model trained on the task spreads
each position over the words, and filling two positions in one step can write a word twice and drop another."""
from __future__ import annotations

import random

WORDS = ["sun", "sea", "sky", "river", "grass", "coin", "book", "road", "room", "gate", "bus", "key", "year", "box",
         "text", "morning"]  # one token each, with the space before them
HEAD = "Put these words in any order, each once:"


def make_item(rng: random.Random) -> tuple[str, str, str]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    # Drawn uniformly among all orders: training data must spread each position's marginal over the words
    # (a fixed pick, say the prompt's order, would teach one answer, and parallel decoding would never err on it).
    order = " ".join(rng.sample(words, len(words)))
    return f"{HEAD} {', '.join(words)}.", f"#### {order}", order


def is_valid(prompt: str, output: str) -> bool:
    """The words after the output's last `####` are the prompt's words, each once, in any order."""
    _, marker, answer = output.rpartition("####")
    words = prompt.removeprefix(HEAD).strip().removesuffix(".").split(", ")
    return bool(marker) and sorted(answer.split()) == sorted(words)
