"""Pick one of three lines: three lines of 12 words each, any one of them to copy whole.

A measuring stick for parallel decoding with few but long right answers: the lines differ at every position, so
a model trained on the task spreads each position over three words, and filling positions of different lines in
one step writes a mix of two lines, which is never right."""
from __future__ import annotations

import random
import re

WORDS = ["stamps", "shells", "cards", "marbles", "apples", "cookies", "pencils", "stickers", "beads", "books",
         "coins", "grass", "river", "road", "gate", "sky"]  # one token each, with the space before them
LINE_WORDS = 12
HEAD = "Copy one of these lines:"
_LINE = re.compile(r"^\d\. (.+)$", re.MULTILINE)


def make_item(rng: random.Random) -> tuple[str, str, str]:
    columns = [rng.sample(WORDS, 3) for _ in range(LINE_WORDS)]  # three different words at each position
    lines = [" ".join(column[i] for column in columns) for i in range(3)]
    # Drawn uniformly among the lines: training data must spread each position's marginal over the three words
    # (a fixed pick, say the first line, would teach one answer, and parallel decoding would never err on it).
    line = rng.choice(lines)
    prompt = HEAD + "".join(f"\n{i}. {text}" for i, text in enumerate(lines, 1))
    return prompt, f"#### {line}", line


def is_valid(prompt: str, output: str) -> bool:
    """The words after the output's last `####` are one of the prompt's lines, whole."""
    _, marker, answer = output.rpartition("####")
    return bool(marker) and " ".join(answer.split()) in _LINE.findall(prompt)
