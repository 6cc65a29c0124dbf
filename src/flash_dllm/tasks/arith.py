"""GSM8K-style word problems: two people, one kind of object, 2-4 arithmetic operations."""
from __future__ import annotations

import random

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ivy", "Noah", "Ella"]
OBJECTS = ["apples", "marbles", "books", "stickers", "coins", "pencils", "cookies", "cards", "shells", "stamps"]


def make_item(rng: random.Random) -> tuple[str, str, str]:
    first, second = rng.sample(NAMES, 2)
    thing = rng.choice(OBJECTS)
    counts = {first: rng.randint(2, 30)}
    story = [f"{first} has {counts[first]} {thing}."]
    steps: list[str] = []

    def relation():  # the second person's count, from the first's
        a = counts[first]
        kind = rng.choice(["more", "fewer", "times"])
        if kind == "fewer" and a > 2:
            b = rng.randint(1, a - 1)
            counts[second] = a - b
            story.append(f"{second} has {b} fewer {thing} than {first}.")
            steps.append(f"{second} has {a} - {b} = {a - b} {thing}.")
        elif kind == "times" and a <= 20:
            k = rng.randint(2, 4)
            counts[second] = a * k
            story.append(f"{second} has {k} times as many {thing} as {first}.")
            steps.append(f"{second} has {a} * {k} = {a * k} {thing}.")
        else:
            b = rng.randint(1, 20)
            counts[second] = a + b
            story.append(f"{second} has {b} more {thing} than {first}.")
            steps.append(f"{second} has {a} + {b} = {a + b} {thing}.")

    def event():
        who = rng.choice([p for p in counts])
        a = counts[who]
        kind = rng.choice(["buy", "lose", "give", "double"])
        other = second if who == first else first
        if kind == "give" and other in counts and a > 1:
            b = rng.randint(1, a - 1)
            counts[who], counts[other] = a - b, counts[other] + b
            story.append(f"{who} gives {b} {thing} to {other}.")
            steps.append(f"{who} has {a} - {b} = {a - b} {thing}. {other} has {counts[other] - b} + {b} = "
                         f"{counts[other]} {thing}.")
        elif kind == "lose" and a > 1:
            b = rng.randint(1, a - 1)
            counts[who] = a - b
            story.append(f"{who} loses {b} {thing}.")
            steps.append(f"{who} has {a} - {b} = {a - b} {thing}.")
        elif kind == "double" and a <= 40:
            counts[who] = 2 * a
            story.append(f"{who} doubles the number of {thing}.")
            steps.append(f"{who} has {a} * 2 = {2 * a} {thing}.")
        else:
            b = rng.randint(1, 25)
            counts[who] = a + b
            story.append(f"{who} buys {b} more {thing}.")
            steps.append(f"{who} has {a} + {b} = {a + b} {thing}.")

    num_ops = rng.randint(2, 4)
    relation()
    while len(steps) < num_ops - 1:
        event()
    if rng.random() < 0.4:
        total = counts[first] + counts[second]
        question = f"How many {thing} do {first} and {second} have together?"
        steps.append(f"Together they have {counts[first]} + {counts[second]} = {total} {thing}.")
        answer = total
    else:
        if len(steps) < num_ops:
            event()
        who = rng.choice([first, second])
        question = f"How many {thing} does {who} have now?"
        answer = counts[who]
    prompt = " ".join(story) + " " + question
    return prompt, " ".join(steps) + f" #### {answer}", str(answer)
