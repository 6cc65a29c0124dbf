"""Multi-key retrieval: several labelled five-digit keys hidden in filler text; the question names one of them.

Harder than passkey for a routing: each key is stated once (passkey repeats its needle), and the other keys
are distractors of the same form, so the region read must hold the needle whose label the question names.
"""
from __future__ import annotations

import random

from .passkey import default_token_count, filler

LABELS = ["red", "blue", "green", "yellow", "black", "white", "silver", "golden", "wooden", "iron", "glass",
          "stone"]
HEAD = "Some door keys are hidden in the text below. Each door has its own key. Remember them."


def make_item(rng: random.Random, num_tokens: int = 512, count_tokens=default_token_count) -> tuple[str, str, str]:
    """A prompt of at most about `num_tokens` tokens holding 2-6 keys, each under its own label."""
    labels = rng.sample(LABELS, rng.randint(2, 6))
    keys = [str(rng.randint(10000, 99999)) for _ in labels]
    needles = [f"The {label} door key is {key}." for label, key in zip(labels, keys)]
    asked = rng.randrange(len(labels))
    question = f"What is the {labels[asked]} door key?"
    sentences = filler(rng, num_tokens - count_tokens(" ".join([HEAD, *needles, question])), count_tokens)
    for needle in needles:
        sentences.insert(rng.randint(0, len(sentences)), needle)
    prompt = f"{HEAD} {' '.join(sentences)} {question}"
    return prompt, f"The {labels[asked]} door key is {keys[asked]}. #### {keys[asked]}", keys[asked]
