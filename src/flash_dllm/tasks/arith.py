"""GSM8K-style word problems: two people, one kind of object, 2-4 arithmetic operations.

The first person's count is given; the second's is defined from it (more / fewer / times) and then
changes through events (buys, loses, doubles); the question asks for the second person's count or the
total. Events touch only the second person, so each step reads its operand from the step before it:
the embedded 11M-parameter model confused the two people's counts when both changed (training/README.md)."""
from __future__ import annotations

import random

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ivy", "Noah", "Ella"]
OBJECTS = ["apples", "marbles", "books", "stickers", "coins", "pencils", "cookies", "cards", "shells", "stamps"]


def _relation(rng: random.Random, first: str, second: str, a: int, thing: str) -> tuple[str, str, int]:
    """The second person's count from the first's: (story sentence, worked step, count)."""
    kind = rng.choice(["more", "fewer", "times"])
    if kind == "fewer" and a > 2:
        b = rng.randint(1, a - 1)
        return f"{second} has {b} fewer {thing} than {first}.", f"{second} has {a} - {b} = {a - b} {thing}.", a - b
    if kind == "times" and a <= 20:
        k = rng.randint(2, 4)
        return (f"{second} has {k} times as many {thing} as {first}.", f"{second} has {a} * {k} = {a * k} {thing}.",
                a * k)
    b = rng.randint(1, 20)
    return f"{second} has {b} more {thing} than {first}.", f"{second} has {a} + {b} = {a + b} {thing}.", a + b


def _event(rng: random.Random, who: str, a: int, thing: str) -> tuple[str, str, int]:
    kind = rng.choice(["buy", "lose", "double"])
    if kind == "lose" and a > 1:
        b = rng.randint(1, a - 1)
        return f"{who} loses {b} {thing}.", f"{who} has {a} - {b} = {a - b} {thing}.", a - b
    if kind == "double" and a <= 40:
        return f"{who} doubles the number of {thing}.", f"{who} has {a} * 2 = {2 * a} {thing}.", 2 * a
    b = rng.randint(1, 25)
    return f"{who} buys {b} more {thing}.", f"{who} has {a} + {b} = {a + b} {thing}.", a + b


def make_item(rng: random.Random) -> tuple[str, str, str]:
    first, second = rng.sample(NAMES, 2)
    thing = rng.choice(OBJECTS)
    start = rng.randint(2, 30)
    sentence, step, count = _relation(rng, first, second, start, thing)
    story, steps = [f"{first} has {start} {thing}.", sentence], [step]
    together = rng.random() < 0.4
    for _ in range(rng.randint(2, 4) - 1 - together):  # the total is an operation too
        sentence, step, count = _event(rng, second, count, thing)
        story.append(sentence)
        steps.append(step)
    if together:
        answer = start + count
        question = f"How many {thing} do {first} and {second} have together?"
        steps.append(f"Together they have {start} + {count} = {answer} {thing}.")
    else:
        answer = count
        question = f"How many {thing} does {second} have now?"
    prompt = " ".join(story) + " " + question
    return prompt, " ".join(steps) + f" #### {answer}", str(answer)
