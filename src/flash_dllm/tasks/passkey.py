"""Passkey retrieval: a five-digit key hidden in long filler text among distractor numbers."""
from __future__ import annotations

import random

FILLER = [
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river flows to the sea.", "Birds sing in the morning.", "The road is long and quiet.",
]
DISTRACTORS = ["The room number is {}.", "The bus leaves at gate {}.", "The order number is {}.",
               "The year on the coin is {}.", "The box holds {} beads."]
QUESTION = "What is the pass key?"


def default_token_count(text: str) -> int:
    """A rough token count for a prompt when no tokenizer is given (about 1.3 tokens a word)."""
    return int(len(text.split()) * 1.3)


def filler(rng: random.Random, budget: int, count_tokens) -> list[str]:
    """Filler sentences, with a distractor number in about 1 of 25, up to `budget` tokens."""
    sentences: list[str] = []
    while True:
        if rng.random() < 0.04:
            sentence = rng.choice(DISTRACTORS).format(rng.randint(10000, 99999))
        else:
            sentence = rng.choice(FILLER)
        budget -= count_tokens(" " + sentence)
        if budget < 0:
            return sentences
        sentences.append(sentence)


def make_item(rng: random.Random, num_tokens: int = 512, count_tokens=default_token_count) -> tuple[str, str, str]:
    """A prompt of at most about `num_tokens` tokens (as counted by `count_tokens`)."""
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    head = "There is a pass key hidden in the text below. Find it and remember it."
    sentences = filler(rng, num_tokens - count_tokens(f"{head} {needle} {QUESTION}"), count_tokens)
    sentences.insert(rng.randint(0, len(sentences)), needle)
    prompt = f"{head} {' '.join(sentences)} {QUESTION}"
    return prompt, f"The pass key is {key}. #### {key}", key
