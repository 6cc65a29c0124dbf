"""Code tracing: a short Python program (assignments, arithmetic, an if, a loop over a small range);
the question is what it prints; the solution traces it line by line."""
from __future__ import annotations

import random

VARIABLES = ["a", "b", "c", "x", "y", "n", "s", "t"]


def _binary(rng: random.Random, left: str, values: dict) -> tuple[str, int, str]:
    """`left op right` with a small constant or another variable; returns (code, value, worked)."""
    op = rng.choice(["+", "-", "*"])
    if rng.random() < 0.5 and len(values) > 1:
        right = rng.choice([v for v in values if v != left])
        r = values[right]
    else:
        right = str(rng.randint(1, 9) if op != "*" else rng.randint(2, 3))
        r = int(right)
    l = values[left]
    value = l + r if op == "+" else l - r if op == "-" else l * r
    return f"{left} {op} {right}", value, f"{l} {op} {r} = {value}"


def make_item(rng: random.Random) -> tuple[str, str, str]:
    names = rng.sample(VARIABLES, 2)
    first, second = names
    values = {first: rng.randint(1, 9)}
    code = [f"{first} = {values[first]}"]
    trace = [f"{first} = {values[first]}."]
    expr, values[second], worked = _binary(rng, first, values)
    code.append(f"{second} = {expr}")
    trace.append(f"{second} = {worked}.")

    target = rng.choice(names)
    limit = rng.randint(2, 20)
    cmp = rng.choice([">", "<"])
    holds = values[target] > limit if cmp == ">" else values[target] < limit
    expr, value, worked = _binary(rng, target, values)
    code += [f"if {target} {cmp} {limit}:", f"    {target} = {expr}"]
    trace.append(f"{values[target]} {cmp} {limit} is {holds}" + (f", so {target} = {worked}." if holds else "."))
    if holds:
        values[target] = value

    loop_var = rng.choice([v for v in VARIABLES if v not in names])
    acc = rng.choice(names)
    count = rng.randint(2, 3)
    op = rng.choice(["+", "-"])
    code += [f"for {loop_var} in range({count}):", f"    {acc} = {acc} {op} {loop_var}"]
    for i in range(count):
        new = values[acc] + i if op == "+" else values[acc] - i
        trace.append(f"{loop_var} = {i}: {acc} = {values[acc]} {op} {i} = {new}.")
        values[acc] = new

    if rng.random() < 0.5:
        code.append(f"print({first} + {second})")
        result = values[first] + values[second]
        trace.append(f"{first} + {second} = {values[first]} + {values[second]} = {result}.")
    else:
        shown = rng.choice(names)
        code.append(f"print({shown})")
        result = values[shown]
        trace.append(f"{shown} is {result}.")
    prompt = "What does this program print?\n" + "\n".join(code)
    return prompt, " ".join(trace) + f" #### {result}", str(result)
