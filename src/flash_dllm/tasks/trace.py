"""Code tracing: a short Python program over one variable (two assignments, an if, a loop over a small
range, a print); the question is what it prints; the solution traces it line by line.

One variable (plus the loop's) keeps the task within reach of the embedded 11M-parameter model, which
confused two variables' values (training/README.md)."""
from __future__ import annotations

import random

VARIABLES = ["a", "b", "c", "x", "y", "n", "s", "t"]


def _update(rng: random.Random, name: str, value: int) -> tuple[str, int, str]:
    """`name op constant`; returns (code, new value, worked)."""
    op = rng.choice(["+", "-", "*"])
    right = rng.randint(2, 3) if op == "*" else rng.randint(1, 9)
    new = value + right if op == "+" else value - right if op == "-" else value * right
    return f"{name} {op} {right}", new, f"{value} {op} {right} = {new}"


def make_item(rng: random.Random) -> tuple[str, str, str]:
    name, loop_var = rng.sample(VARIABLES, 2)
    value = rng.randint(1, 9)
    code = [f"{name} = {value}"]
    expr, value, worked = _update(rng, name, value)
    code.append(f"{name} = {expr}")
    trace = [f"{name} = {worked}."]

    limit = rng.randint(2, 20)
    cmp = rng.choice([">", "<"])
    holds = value > limit if cmp == ">" else value < limit
    expr, new, worked = _update(rng, name, value)
    code += [f"if {name} {cmp} {limit}:", f"    {name} = {expr}"]
    trace.append(f"{value} {cmp} {limit} is {holds}" + (f", so {name} = {worked}." if holds else "."))
    if holds:
        value = new

    count = rng.randint(2, 3)
    op = rng.choice(["+", "-"])
    code += [f"for {loop_var} in range({count}):", f"    {name} = {name} {op} {loop_var}"]
    for i in range(count):
        new = value + i if op == "+" else value - i
        trace.append(f"{loop_var} = {i}: {name} = {value} {op} {i} = {new}.")
        value = new

    code.append(f"print({name})")
    trace.append(f"{name} is {value}.")
    prompt = "What does this program print?\n" + "\n".join(code)
    return prompt, " ".join(trace) + f" #### {value}", str(value)
