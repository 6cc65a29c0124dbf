"""Markdown tables, as every benchmark and the sweep print them."""
from __future__ import annotations


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)
