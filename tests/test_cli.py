"""The `flash-dllm` command line."""
from __future__ import annotations

import json

import pytest
import torch

from flash_dllm.cli import main
from flash_dllm.config import PRESETS


class Terminal:
    """Standard input as a terminal: nothing piped in."""

    def isatty(self) -> bool:
        return True


def test_generate_prompts_and_file(gqa_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 3 + 4?"}) + "\n" +
                       json.dumps({"prompt_token_ids": [0, 5, 6]}) + "\n")
    code = main(["generate", "Tom has 3 apples.", "--file", str(prompts), "--model", str(gqa_checkpoint),
                 "--device", "cpu", "--method", "reference", "--max-tokens", "16", "--block-length", "8",
                 "--steps", "8", "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0
    lines = sorted((json.loads(line) for line in captured.out.splitlines()), key=lambda line: line["index"])
    assert [line["index"] for line in lines] == [0, 1, 2] and not any("error" in line for line in lines)
    assert [line["prompt"] for line in lines] == ["Tom has 3 apples.", "What is 3 + 4?", [0, 5, 6]]
    assert all(line["steps"] <= 8 for line in lines)
    assert "tokens/s" in captured.err and "tokens per step" in captured.err


def test_generate_on_embedded_model(capsys):
    assert main(["generate", "Hello", "--device", "cpu", "--max-tokens", "16", "--block-length", "8"]) == 0
    assert "--- request 0 (argument 1, " in capsys.readouterr().out


def test_info(capsys):
    assert main(["info", "--model", "random:llada-8b", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 8,015,581,184 (16.03 GB in bfloat16)" in out and "KV cache per token: 524,288 bytes" in out
    assert main(["info", "--model", "random:llada-8b", "--device", "cpu"]) == 0  # the dtype it would run in there
    out = capsys.readouterr().out
    assert "runs on: cpu in float32" in out and "(32.06 GB in float32)" in out
    assert "KV cache per token: 1,048,576 bytes (float32, all layers; 1000.0 MiB per 1k tokens)" in out
    assert main(["info"]) == 0  # the embedded model's directory
    assert "architecture: LLaDAModelLM" in capsys.readouterr().out
    assert main(["info", "--model", "random:llada-8b", "--device", "cpu", "--dtype", "bf16",
                 "--quantization", "fp8"]) == 0
    assert "(9.06 GB in bfloat16 with fp8 projections and their scales)" in capsys.readouterr().out


def test_generate_with_fp8_weights(capsys):
    assert main(["generate", "What is 3 + 4?", "--device", "cpu", "--max-tokens", "16", "--block-length", "8",
                 "--quantization", "fp8"]) == 0
    assert "--- request 0 (argument 1, " in capsys.readouterr().out
    assert main(["generate", "x", "--device", "cpu", "--quantization", "int8"]) == 2
    assert "argument --quantization: invalid choice: 'int8' (choose from 'fp8')" in capsys.readouterr().err


def test_bench_forward_on_cpu(capsys):
    assert main(["bench", "forward", "--model", "random:llada-tiny", "--device", "cpu", "--batch-sizes", "1", "2",
                 "--length", "32", "--block-length", "8", "--iters", "2"]) == 0
    table = capsys.readouterr().out
    assert table.count("\n| 2 | 32 |") == 2


def test_errors_are_reported_not_raised(tmp_path, capsys, monkeypatch):
    assert main(["generate", "x", "--model", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", Terminal())
    assert main(["generate", "--device", "cpu"]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert main(["generate", "x", "--device", "cpu", "--max-tokens", "0"]) == 2
    assert "max_tokens must be positive" in capsys.readouterr().err


def test_demo(capsys):
    assert main(["demo", "--device", "cpu", "--items", "2", "--methods", "parallel",
                 "--tasks", "arith", "passkey"]) == 0
    table = capsys.readouterr().out
    assert "| method | arith | passkey@256 | NFE |" in table and "| parallel | " in table and " | 2/2 | " in table


def test_eval_on_embedded_task(gqa_checkpoint, tmp_path, capsys):
    output = tmp_path / "arith.jsonl"
    assert main(["eval", "--task", "arith", "--model", str(gqa_checkpoint), "--device", "cpu", "--limit", "2",
                 "--max-tokens", "16", "--block-length", "8", "--no-progress", "--output", str(output)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_items"] == 2 and summary["sampling"]["max_tokens"] == 16
    assert 0 <= summary["accuracy"] <= 1 and summary["tokens_per_s"] > 0
    assert len(output.read_text().splitlines()) == 2
    assert json.loads((tmp_path / "arith.summary.json").read_text()) == summary


def test_sweep_command(gqa_checkpoint, tmp_path, capsys):
    assert main(["sweep", "--task", "arith", "--model", str(gqa_checkpoint), "--device", "cpu", "--limit", "2",
                 "--no-progress",
                 "--methods", "parallel", "reference", "--threshold", "0.5", "--steps", "8",
                 "--max-tokens", "16", "--block-length", "8", "--out-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| parallel thr=0.5 |" in table and "| reference steps=8 |" in table
    assert (tmp_path / "sweep.png").is_file()


def test_eval_errors(capsys):
    assert main(["eval", "--task", "mbpp", "--data", "/nonexistent/mbpp.jsonl", "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_step_on_cpu(capsys):
    assert main(["bench", "step", "--model", "random:llada-tiny", "--device", "cpu", "--batch-sizes", "1", "2",
                 "--methods", "reference", "dual-cache", "flash-verify", "--prompt-length", "16", "--max-tokens", "16",
                 "--block-length", "8", "--warmup", "1", "--iters", "2"]) == 0
    captured = capsys.readouterr()
    lines = [line.strip("| ").split(" | ") for line in captured.out.splitlines() if line.startswith("| ")]
    header, rows = lines[0], [dict(zip(lines[0], line)) for line in lines[1:]]
    assert header[:9] == ["method", "prompt KV", "read", "batch", "block", "ms/iter", "tokens/iter/req",
                          "query rows/iter/req", "passes/iter"]
    assert all(r["prompt KV"] == "dense" and r["read"] == "1.000" for r in rows)
    assert header[-3:] == ["tok/s @1.0", "tok/s @2.8", "tok/s @5.7"]
    assert [(r["method"], r["batch"]) for r in rows] == [(m, b) for m in ("reference", "dual-cache", "flash-verify")
                                                         for b in ("1", "2")]
    assert all(r["tokens/iter/req"] == "1.00" for r in rows) and "warning" not in captured.err  # forced schedule
    rows_of = {(r["method"], r["batch"]): float(r["query rows/iter/req"]) for r in rows}
    assert all(rows_of["dual-cache", b] < rows_of["reference", b] == 32 for b in ("1", "2"))
    assert all(r["passes/iter"] == "2.00" for r in rows if r["method"] == "flash-verify")  # draft + verify


def test_bench_generate_on_cpu(capsys):
    """End to end through LLM.generate: with random weights (flat confidences) every method decodes one token
    per step, so each request takes max_tokens iterations (reference: its steps), and a batch runs together."""
    assert main(["bench", "generate", "--model", "random:dream-tiny", "--device", "cpu", "--batch-sizes", "1", "3",
                 "--methods", "reference", "flash-verify", "elastic", "--prompt-length", "12", "--max-tokens", "16",
                 "--block-length", "8"]) == 0
    captured = capsys.readouterr()
    lines = [line.strip("| ").split(" | ") for line in captured.out.splitlines() if line.startswith("| ")]
    rows = [dict(zip(lines[0], line)) for line in lines[1:]]
    assert [(r["method"], r["batch"], r["block"]) for r in rows] == [
        ("reference", "1", "8"), ("reference", "3", "8"), ("flash-verify", "1", "8"), ("flash-verify", "3", "8"),
        ("elastic", "1", "-"), ("elastic", "3", "-")]
    for r in rows:
        assert r["iterations"] == "16" and r["tokens/step"] == "1.00" and int(r["tokens"]) == 16 * int(r["batch"])
        # both printed with 2 decimals: wall s to within 5 ms (over 16 iterations), ms/iter to within 0.005
        assert float(r["ms/iter"]) == pytest.approx(float(r["wall s"]) * 1e3 / 16, abs=0.005e3 / 16 + 0.006)
        assert float(r["NFE/request"]) == (32.0 if r["method"] == "flash-verify" else 16.0)  # draft + verify


BAD_LINES = [  # a good line, then a bad one: the good prompt finishes, the bad one is reported with file:line
    ("prompts.jsonl", b'{"prompt": "ok"}\n{"prompt": "unclosed\n', "not valid JSON (Unterminated string"),
    ("prompts.jsonl", b'{"prompt": "ok"}\n[1, 2]\n', "expected an object with a prompt, messages or prompt_token_ids"),
    ("prompts.jsonl", b'{"prompt": "ok"}\n{"prompt_token_ids": "1 2"}\n', "prompt_token_ids must be a list, got str"),
    ("prompts.txt", b"fine\nbad \xff byte\n", "not valid UTF-8 (byte 5)"),
]


@pytest.mark.parametrize("name, content, message", BAD_LINES, ids=["json", "not-an-object", "wrong-type", "utf8"])
def test_bad_prompt_lines_fail_alone(gqa_checkpoint, tmp_path, capsys, name, content, message):
    (tmp_path / name).write_bytes(content)
    code = main(["generate", "--file", str(tmp_path / name), "--model", str(gqa_checkpoint), "--device", "cpu",
                 "--max-tokens", "8", "--block-length", "8", "--json"])
    captured = capsys.readouterr()
    assert code == 1
    error, summary = captured.err.splitlines()
    assert error.startswith(f"flash-dllm: error: prompt 1 ({tmp_path / name}:2): {message}")
    assert summary.startswith("1 requests (1 failed), ")
    good, bad = sorted((json.loads(line) for line in captured.out.splitlines()), key=lambda line: line["index"])
    assert good["finish_reason"] == "length" and "error" not in good
    assert (bad["finish_reason"], bad["prompt"]) == ("error", None)
    assert bad["error"] == error.removeprefix("flash-dllm: error: ")


def test_blank_lines_are_skipped(gqa_checkpoint, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("\none\n   \ntwo\n")
    assert main(["generate", "--file", str(tmp_path / "prompts.txt"), "--model", str(gqa_checkpoint), "--device",
                 "cpu", "--max-tokens", "8", "--block-length", "8"]) == 0
    out = capsys.readouterr().out
    assert f"({tmp_path}/prompts.txt:2, " in out and f"({tmp_path}/prompts.txt:4, " in out


def test_one_line_errors_for_bad_arguments_and_configs(tmp_path, capsys):
    assert main(["generate", "fine", "bad \udcff", "--device", "cpu", "--max-tokens", "8", "--block-length", "8"]) == 1
    captured = capsys.readouterr()  # argv's escape for a non-UTF-8 byte: that prompt fails alone
    assert captured.err.splitlines()[0] == "flash-dllm: error: prompt 1 (argument 2): not valid UTF-8"
    assert "--- request 0 (argument 1, " in captured.out
    assert main(["generate", "hi", "--device", "tpu:0"]) == 2
    assert "unknown device 'tpu:0'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", "hi", "--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
    config = {k: v for k, v in PRESETS["llada-tiny"].items() if k not in ("vocab_size", "embedding_size")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["info", "--model", str(tmp_path)]) == 2
    assert "config.json: missing required key 'vocab_size'" in capsys.readouterr().err
