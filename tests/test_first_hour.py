"""What a new user hits in their first hour (issue 37), each case with the input as the issue wrote it: a one-line
error naming the culprit, or the behaviour asked for, and the other requests of the call still finishing."""
from __future__ import annotations

import argparse
import json

import pytest

from flash_dllm import LLM, SamplingParams
from flash_dllm.cli import main
from flash_dllm.eval.embedded import run_task
from flash_dllm.eval.harness import evaluate
from flash_dllm.llm import RequestOutput

SHORT = ["--device", "cpu", "--max-tokens", "8", "--block-length", "8", "--no-progress"]


def one_line(err: str, prefix: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_batch_size=4)


# 1. `flash-dllm demo --items 0 --methods parallel`

def test_demo_with_no_items_is_a_usage_error(capsys):
    assert main(["demo", "--items", "0", "--methods", "parallel"]) == 2
    one_line(capsys.readouterr().err, "flash-dllm demo: error: argument --items: must be at least 1, got 0")


def test_run_task_with_no_items_is_an_error(llm):
    with pytest.raises(ValueError, match="^arith: no items to run$"):
        run_task(llm, "arith", "parallel", [], SamplingParams())


@pytest.mark.parametrize("argv", [["bench", "step", "--batch-sizes", "1", "0"], ["serve", "--max-batch", "-1"],
                                  ["generate", "x", "--batch-size", "zero"]])
def test_counts_out_of_range_are_usage_errors(argv, capsys):
    assert main(argv) == 2
    err = one_line(capsys.readouterr().err, "flash-dllm ")
    assert "error: argument --" in err and err.endswith("--help)")


def test_default_graph_batch_sizes_stay_within_the_batch():
    from flash_dllm.cli import graph_batch_sizes

    assert graph_batch_sizes(argparse.Namespace(graph_batch_sizes=None, max_batch=1)) == (1,)
    assert graph_batch_sizes(argparse.Namespace(graph_batch_sizes=None, max_batch=32)) == (1, 2)
    assert graph_batch_sizes(argparse.Namespace(graph_batch_sizes=[4, 2, 2], max_batch=32)) == (2, 4)


def test_graph_batch_sizes_beyond_the_batch_are_an_error(capsys):
    assert main(["serve", "--max-batch", "4", "--graph-batch-sizes", "1", "8", "--port", "0"]) == 2
    one_line(capsys.readouterr().err, "flash-dllm: error: --graph-batch-sizes 8 is more than --max-batch 4: no batch "
                                      "would replay it")


# 2. `flash-dllm eval --task arith --limit 0`, `--limit -3`

@pytest.mark.parametrize("limit", ["0", "-3"])
def test_eval_limit_out_of_range(limit, capsys):
    assert main(["eval", "--task", "arith", "--limit", limit]) == 2
    one_line(capsys.readouterr().err, f"flash-dllm eval: error: argument --limit: must be at least 1, got {limit}")


@pytest.mark.parametrize("limit", [0, -3])
def test_evaluate_limit_out_of_range(llm, limit):
    with pytest.raises(ValueError, match=f"limit must be a positive number of items, got {limit}"):
        evaluate(llm, "arith", SamplingParams(), limit=limit, progress=False)


# 3. `flash-dllm generate "   "`: one rule for a blank prompt everywhere

def test_whitespace_prompt_fails_alone_on_the_command_line(capsys):
    assert main(["generate", "What is 3 + 4?", "   ", *SHORT]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == "flash-dllm: error: prompt 1 (argument 2): the prompt is only whitespace"
    assert "--- request 0 (argument 1, " in captured.out


def test_whitespace_prompt_fails_alone_in_the_api(llm):
    ok, blank, empty = llm.generate(["What is 3 + 4?", " \n\t", ""], SamplingParams(max_tokens=8, block_length=8))
    assert ok.error is None and ok.token_ids
    assert (blank.finish_reason, blank.error) == ("error", "prompt 1: the prompt is only whitespace")
    assert empty.error == "prompt 2: the prompt is empty"


# 4. `--kv-budget 0.5` without `--kv-routing`

def test_kv_budget_without_routing_on_the_command_line(capsys):
    assert main(["generate", "x", "--kv-budget", "0.5", *SHORT]) == 2
    one_line(capsys.readouterr().err, "flash-dllm: error: kv_budget (0.5) applies only with kv_routing")
    assert main(["bench", "step", "--kv-budget", "0.5"]) == 2
    one_line(capsys.readouterr().err, "flash-dllm: error: --kv-budget applies only with --kv-routing")


def test_eval_summary_records_no_budget_without_routing(llm):
    summary = evaluate(llm, "arith", SamplingParams(max_tokens=8, block_length=8), limit=1, progress=False,
                       warmup=False).summary
    assert summary["sampling"]["kv_routing"] is None and summary["sampling"]["kv_budget"] is None


# 5. `flash-dllm generate -`, `--file -`, and prompts piped in

def test_dash_reads_one_prompt_from_stdin(pipe_stdin, capsys):
    pipe_stdin(b"What does this program print?\na = 2\nprint(a)\n")
    assert main(["generate", "-", "--json", *SHORT]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["prompt"] == "What does this program print?\na = 2\nprint(a)\n"


def test_piped_prompt_without_arguments(pipe_stdin, capsys):
    pipe_stdin(b"What is 3 + 4?")
    assert main(["generate", *SHORT]) == 0
    assert "--- request 0 (stdin, " in capsys.readouterr().out


@pytest.mark.parametrize("data", [b"What is 3 + 4?\n\n   \n   \nWhat is 5 + 1?\n",
                                  b'{"prompt": "What is 3 + 4?"}\n{"prompt": "   "}\n{"prompt": "What is 5 + 1?"}\n'],
                         ids=["text", "jsonl"])
def test_file_dash_reads_stdin_line_by_line(pipe_stdin, capsys, data):
    pipe_stdin(data)
    jsonl = data.startswith(b"{")
    assert main(["generate", "--file", "-", "--json", *SHORT]) == (1 if jsonl else 0)
    captured = capsys.readouterr()
    records = sorted((json.loads(line) for line in captured.out.splitlines()), key=lambda r: r["index"])
    assert [r["prompt"] for r in records if "error" not in r] == ["What is 3 + 4?", "What is 5 + 1?"]
    if jsonl:  # the blank jsonl prompt fails alone, named by its line
        assert captured.err.splitlines()[0] == ("flash-dllm: error: prompt 1 (<stdin>:2): the prompt is only "
                                                "whitespace")


def test_stdin_is_read_once(pipe_stdin, capsys):
    pipe_stdin(b"x")
    assert main(["generate", "-", "--file", "-", *SHORT]) == 2
    one_line(capsys.readouterr().err, "flash-dllm: error: standard input (-) can be read once")


# 6. `flash-dllm bench generate --batch-sizes 1 32 ...` (what it loads is in --help; the embedded model's tokens)

def test_bench_help_names_its_default_model(capsys):
    assert main(["bench", "generate", "--help"]) == 0
    assert "(default: random:llada-8b)" in " ".join(capsys.readouterr().out.split())


def test_bench_generate_on_the_embedded_model_counts_tokens(capsys):
    from flash_dllm.llm import default_model_path

    assert main(["bench", "generate", "--model", str(default_model_path()), "--device", "cpu", "--batch-sizes", "1",
                 "--methods", "dual-cache", "--max-tokens", "32"]) == 0
    captured = capsys.readouterr()
    lines = [line.strip("| ").split(" | ") for line in captured.out.splitlines() if line.startswith("| ")]
    row = dict(zip(lines[0], lines[1]))
    assert int(row["tokens"]) > 0 and float(row["tok/s"]) > 0 and "warning" not in captured.err
    assert "# prompts: the embedded tasks (chat)" in captured.out
    assert main(["bench", "generate", "--model", str(default_model_path()), "--prompt-length", "64"]) == 2
    one_line(capsys.readouterr().err, "flash-dllm: error: --prompt-length sets the random prompts' length")


# 7. A failed prompt keeps every field's type

def test_failed_output_keeps_field_types(llm):
    ok, failed = llm.generate(["What is 3 + 4?", [10**9]], SamplingParams(max_tokens=8, block_length=8))
    assert failed.text == "" and failed.finish_reason == "error" and "outside the vocabulary" in failed.error
    assert failed.text.strip() == "" and failed.token_ids == [] and isinstance(ok.text, str)
    assert RequestOutput.failed(0, "x", "prompt 0: why").text == ""


# 9. Defaults in sight

@pytest.mark.parametrize("command, defaults", [
    (["generate"], ["--method", "(default: parallel)", "--max-tokens", "(default: 128)", "--block-length",
                    "(default: 32)", "--temperature", "(default: 0.0)", "--seed", "(default: 0)"]),
    (["serve"], ["(default: 127.0.0.1)", "(default: 8000)", "--max-batch", "(default: 32)",
                 "--max-queue", "(default: 256)"]),
    (["demo"], ["--items ITEMS", "(default: 4)"]),
])
def test_help_shows_defaults(command, defaults, capsys):
    assert main([*command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in defaults:
        assert default in text, default


# 12. `flash-dllm demo` shows what the model answered (issue 54 redesigned it: test_first_hour_2.py)

def test_demo_shows_an_answer(capsys):
    assert main(["demo", "--device", "cpu", "--methods", "parallel", "dual-cache", "--tasks", "trace"]) == 0
    out = capsys.readouterr().out
    assert out.count("| parallel | ") == 1 and out.count("| dual-cache | ") == 1
    assert "\nparallel on trace #0: " in out and "\nanswer: " in out

