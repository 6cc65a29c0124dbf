"""Generated programs run in their own interpreter: failures, hangs and crashes are failures, never hangs."""
from __future__ import annotations

import time

import pytest

from flash_dllm.eval.benchmarks import HumanEval, get_benchmark
from flash_dllm.eval.fewshot import MBPP
from flash_dllm.eval.sandbox import run_program, run_programs


@pytest.mark.parametrize("program, status", [
    ("assert sorted([3, 1]) == [1, 3]\nprint('noise')", "passed"),
    ("assert 1 == 2", "failed: AssertionError"),
    ("def f(:\n", "failed: SyntaxError"),
    ("import ctypes\nctypes.string_at(0)", "crashed: signal"),             # segfault
    ("import os\nos._exit(0)", "failed: exited early"),                    # success exit code without the nonce
    ("import sys\nsys.exit(0)", "failed: exited early"),
    ("x = bytearray(8 << 30)", "failed: MemoryError"),                     # over the memory limit
    ("import shutil\nshutil.rmtree('/tmp/anything')", "failed: TypeError"),  # disabled by the guard
])
def test_outcomes(program, status):
    assert run_program(program, timeout=10).status.startswith(status)


def test_infinite_loop_times_out_quickly():
    start = time.perf_counter()
    results = run_programs(["while True:\n    pass", "assert True"], timeout=1.0)
    assert [r.status for r in results] == ["timed out", "passed"]
    assert time.perf_counter() - start < 5


def test_humaneval_checker():
    humaneval = HumanEval()
    humaneval.timeout_s = 2.0  # for the infinite loop below
    docs = [e.doc for e in humaneval.examples(chat=False, limit=4)]
    right = [doc["canonical_solution"] for doc in docs]
    assert all(v.correct for v in humaneval.score(docs, right, chat=False))
    wrong = ["    return None\n", "    while True:\n        pass\n", "    import ctypes; ctypes.string_at(0)\n",
             "    raise ValueError\n"]
    assert not any(v.correct for v in humaneval.score(docs, wrong, chat=False))
    # an instruct model answers with the whole function in a code block; a base model's text runs on past it
    fenced = [f"Here it is:\n```python\n{doc['prompt']}{doc['canonical_solution']}```\nIt works." for doc in docs]
    assert all(v.correct for v in humaneval.score(docs, fenced, chat=True))
    trailing = [doc["canonical_solution"] + "\n\ndef unrelated(:\n" for doc in docs]
    assert all(v.correct for v in humaneval.score(docs, trailing, chat=False))


def test_mbpp_checker():
    mbpp = get_benchmark("mbpp")
    right = [f"{shot['code']}\n[DONE]\nYou are an expert" for shot in MBPP]
    assert all(v.correct for v in mbpp.score(MBPP, right, chat=False))
    chat = [f"[BEGIN]\n```python\n{shot['code']}\n```\n[DONE]" for shot in MBPP]
    assert all(v.correct for v in mbpp.score(MBPP, chat, chat=True))
    assert not any(v.correct for v in mbpp.score(MBPP, ["def nothing():\n  pass\n[DONE]"] * 3, chat=False))
