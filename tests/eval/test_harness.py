"""The evaluation loop: records, summary accounting, the results files, and the progress bar."""
from __future__ import annotations

import json
import sys

import pytest

from flash_dllm import LLM, RequestOutput, SamplingParams
from flash_dllm.eval.harness import evaluate, summary_path, wilson_interval, write_result
from flash_dllm.extras import MissingExtra
from flash_dllm.tasks import load_test_set

PARAMS = SamplingParams(method="parallel", max_tokens=16, block_length=8)


class ScriptedLLM:
    """Answers from a script, with fixed token counts and steps: the harness's arithmetic checked exactly."""
    use_chat_template = False
    path = None

    def __init__(self, answers: list[str], batch_size: int = 2):
        self.answers = answers
        self.engine = type("Engine", (), {"scheduler": type("Scheduler", (), {"max_batch_size": batch_size})})
        self.calls = []

    def generate(self, prompts, params, use_tqdm=None):
        prompts = [prompts] if isinstance(prompts, str) else prompts
        self.calls.append(len(prompts))
        return [RequestOutput(request_id=0, prompt=p, prompt_token_ids=[], text=self.answers[i % len(self.answers)],
                              token_ids=[7] * (i + 1), finish_reason="stop", nfe=4, steps=2, query_rows=0, time_s=0.1)
                for i, p in enumerate(prompts)]


def test_accounting_with_scripted_outputs(capsys):
    items = load_test_set("arith")[:10]
    llm = ScriptedLLM([f"#### {items[0].answer}", "#### -1"])
    result = evaluate(llm, "arith", PARAMS, limit=10, progress=True)
    assert llm.calls == [2, 8, 2]  # warm-up (one batch), then batches of 4 x batch size 2
    assert [r["index"] for r in result.records] == list(range(10))
    assert [r["prompt"] for r in result.records] == [item.prompt for item in items]
    s = result.summary
    assert s["num_items"] == 10 and s["num_correct"] == sum(r["correct"] for r in result.records)
    assert s["accuracy"] == s["num_correct"] / 10 and s["num_correct"] >= 1
    assert s["num_tokens"] == sum(range(1, 9)) + sum(range(1, 3))
    assert s["tokens_per_step"] == s["num_tokens"] / 20 and s["nfe"] == 4 and s["steps"] == 2
    assert s["tokens_per_s"] == s["num_tokens"] / s["generation_time_s"]
    assert s["sampling"]["method"] == "parallel" and s["task"] == "arith" and s["world_size"] == 1
    bar = capsys.readouterr().err
    assert "acc=" in bar and "tok_s=" in bar


def test_evaluate_tiny_checkpoint_and_write(mha_checkpoint, tmp_path):
    llm = LLM(str(mha_checkpoint), device="cpu", dtype="float32", max_batch_size=2)
    result = evaluate(llm, "arith", PARAMS, limit=3, progress=False)
    direct = llm.generate([item.prompt for item in load_test_set("arith")[:3]], PARAMS)
    assert [r["output"] for r in result.records] == [out.text for out in direct]
    assert [r["num_tokens"] for r in result.records] == [len(out.token_ids) for out in direct]
    record = result.records[0]
    assert {"prompt", "output", "correct", "nfe", "steps", "time_s"} <= record.keys()
    assert result.summary["chat_template"] is True and result.summary["model"] == str(mha_checkpoint)

    output = tmp_path / "out" / "arith.jsonl"
    write_result(result, output)
    assert [json.loads(line) for line in output.read_text().splitlines()] == json.loads(json.dumps(result.records))
    assert summary_path(output).name == "arith.summary.json"
    assert json.loads(summary_path(output).read_text())["num_items"] == 3


def test_passkey_items_of_one_length_and_the_accuracy_interval():
    items = [item for item in load_test_set("passkey") if item.length == 512][:3]
    llm = ScriptedLLM([f"#### {items[0].answer.split('####')[-1].strip()}", "no"])
    summary = evaluate(llm, "passkey", PARAMS, limit=3, length=512, progress=False, warmup=False).summary
    assert summary["length"] == 512 and summary["num_items"] == 3 and summary["num_correct"] >= 1
    low, high = summary["accuracy_ci95"]
    assert 0 < low < summary["accuracy"] < high < 1
    assert wilson_interval(0, 10)[0] == 0 and wilson_interval(10, 10)[1] == 1
    assert summary["prompt_kv_read"] is None  # no routing
    with pytest.raises(ValueError, match="passkey has items of 256, 512"):
        evaluate(llm, "passkey", PARAMS, length=300, progress=False)


def test_a_missing_scorer_module_stops_before_any_generation(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if math-verify were not installed
    llm = ScriptedLLM(["#### 1"])
    with pytest.raises(MissingExtra, match=r"^task math500 needs the eval extra: pip install 'flash-dllm\[eval\]' "
                                           r"\(missing: math_verify\)$"):
        evaluate(llm, "math500", PARAMS, progress=False)
    assert llm.calls == []
