"""Requests fail alone (issue 13): every case measured there gives a one-line error naming the culprit (the
prompt's index and argument or file:line, the setting and its range, the file and tensor), and the other
requests of the same call finish. Errors in the call itself (a setting, the model) stop it with one line."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache import KVCache
from flash_dllm.cli import main
from flash_dllm.config import PRESETS
from flash_dllm.models import random_model, save_checkpoint

README = Path(__file__).parents[1] / "README.md"
SHORT = ["--max-tokens", "8", "--block-length", "8"]


@pytest.fixture(scope="module")
def llm(gqa_checkpoint):
    return LLM(str(gqa_checkpoint), device="cpu", dtype="float32")


def run(capsys, *argv) -> tuple[int, list[dict], list[str]]:
    """`flash-dllm generate --json`: exit code, the JSON records by index, stderr's lines."""
    code = main(["generate", "--device", "cpu", "--json", "--no-progress", *argv])
    captured = capsys.readouterr()
    records = sorted((json.loads(line) for line in captured.out.splitlines()), key=lambda r: r["index"])
    return code, records, captured.err.splitlines()


def run_file(capsys, tmp_path, lines: list[str], *argv) -> tuple[int, list[dict], list[str], Path]:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return (*run(capsys, "--file", str(path), *argv), path)


def assert_fails_alone(code: int, records: list[dict], err: list[str], bad: int, error: str):
    """Exactly prompt `bad` failed with `error` (a regex) on one stderr line; the others finished."""
    assert code == 1
    errors = [line for line in err if line.startswith("flash-dllm: error: ")]
    assert len(errors) == 1 and re.fullmatch("flash-dllm: error: " + error, errors[0]), err
    assert records[bad]["finish_reason"] == "error" and records[bad]["error"] == errors[0][len("flash-dllm: error: "):]
    assert all(r["finish_reason"] in ("stop", "length") and "error" not in r for i, r in enumerate(records) if i != bad)


def assert_one_line(code: int, err: list[str], error: str):
    """A call-level error: exit code 2 and one stderr line."""
    assert code == 2 and len(err) == 1 and re.fullmatch("flash-dllm: error: " + error, err[0]), err


def assert_api_fails_alone(llm, bad_prompt, error: str, params: SamplingParams | None = None):
    params = params or SamplingParams(max_tokens=8, block_length=8)
    good, bad, also_good = llm.generate(["fine", bad_prompt, [0, 5, 6]], params)
    assert bad.finish_reason == "error" and re.fullmatch("prompt 1: " + error, bad.error), bad.error
    assert good.finish_reason in ("stop", "length") and also_good.finish_reason in ("stop", "length")


# ----------------------------------------------------------------------------- one bad prompt among good ones

def test_out_of_vocabulary_id(llm, gqa_checkpoint, tmp_path, capsys):
    assert_api_fails_alone(llm, [1, 2, 100000], "token id 100000 is outside the vocabulary of 320")
    lines = ['{"prompt": "ok"}', '{"prompt_token_ids": [1, 2, 100000]}', '{"prompt": "also ok"}']
    code, records, err, path = run_file(capsys, tmp_path, lines, "--model", str(gqa_checkpoint), *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape(f"prompt 1 ({path}:2): token id 100000 is outside the "
                                                        f"vocabulary of 320"))


def test_prompt_longer_than_the_context(llm, gqa_checkpoint, tmp_path, capsys):
    error = "prompt of 1020 tokens \\+ max_tokens 8 exceeds the model's maximum sequence length of 1024"
    assert_api_fails_alone(llm, [5] * 1020, error)
    lines = ['{"prompt": "ok"}', json.dumps({"prompt_token_ids": [5] * 1020})]
    code, records, err, path = run_file(capsys, tmp_path, lines, "--model", str(gqa_checkpoint), *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape(f"prompt 1 ({path}:2): ") + error)


@pytest.mark.parametrize("line, error", [
    ('{"prompt": 5}', "prompt must be a str, got int"),
    ('{"messages": "hi"}', "messages must be a list, got str"),
    ('{"prompt_token_ids": "1 2 3"}', "prompt_token_ids must be a list, got str"),
    ('{"prompt_token_ids": [1, "2"]}', "a prompt is a string, a list of token ids or a list of .* messages, got list"),
    ('{"messages": [{"role": "user", "content": 5}]}', "a prompt is a string, a list of token ids .*, got list"),
    ('{"text": "hi"}', "expected an object with a prompt, messages or prompt_token_ids key"),
], ids=["prompt-int", "messages-str", "ids-str", "ids-mixed", "content-int", "no-key"])
def test_wrong_type_in_jsonl(gqa_checkpoint, tmp_path, capsys, line, error):
    code, records, err, path = run_file(capsys, tmp_path, ['{"prompt": "ok"}', line], "--model", str(gqa_checkpoint),
                                        *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape(f"prompt 1 ({path}:2): ") + error)


def test_wrong_type_in_the_api(llm):
    assert_api_fails_alone(llm, 5, "a prompt is a string, a list of token ids or a list of .* messages, got int")
    assert_api_fails_alone(llm, [{"role": "user"}], "a prompt is a string, .* messages, got list")


def test_malformed_jsonl_line_2_is_reported_as_file_2(gqa_checkpoint, tmp_path, capsys):
    lines = ['{"prompt": "ok"}', '{"prompt": "unclosed', '{"prompt": "also ok"}']
    code, records, err, path = run_file(capsys, tmp_path, lines, "--model", str(gqa_checkpoint), *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape(f"prompt 1 ({path}:2): not valid JSON (Unterminated "
                                                        f"string starting at, column 12)"))


def test_non_utf8_file(gqa_checkpoint, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"ok\nbad \xff byte\nalso ok\n")
    code, records, err = run(capsys, "--file", str(path), "--model", str(gqa_checkpoint), *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape(f"prompt 1 ({path}:2): not valid UTF-8 (byte 5)"))


def test_non_utf8_prompt_argument(gqa_checkpoint, capsys):
    code, records, err = run(capsys, "ok", "bad \udcff", "--model", str(gqa_checkpoint), *SHORT)  # argv's escape
    assert_fails_alone(code, records, err, 1, re.escape("prompt 1 (argument 2): not valid UTF-8"))


def test_non_utf8_prompt_in_the_api(llm):
    assert_api_fails_alone(llm, "bad \udcff", "the prompt is not valid UTF-8 text")


def test_cache_too_small_for_one_request_of_a_mixed_batch(gqa_checkpoint, tmp_path, capsys):
    budget = 40 * KVCache.bytes_per_row(LLM(str(gqa_checkpoint), device="cpu").config, torch.float32)
    small = LLM(str(gqa_checkpoint), device="cpu", kv_cache_bytes=budget)
    params = SamplingParams(method="dual-cache", max_tokens=8, block_length=8)
    error = ("a sequence of 68 tokens can never fit in a KV cache of 40 tokens; raise kv_cache_bytes or shorten the "
             "request")
    assert_api_fails_alone(small, [5] * 60, error, params)
    lines = ['{"prompt_token_ids": [5, 6]}', json.dumps({"prompt_token_ids": [5] * 60}), '{"prompt": "ok"}']
    code, records, err, path = run_file(capsys, tmp_path, lines, "--model", str(gqa_checkpoint), "--method",
                                        "dual-cache", "--kv-cache-bytes", str(budget), *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape(f"prompt 1 ({path}:2): {error}"))


@pytest.mark.parametrize("empty", ["", []], ids=["string", "list"])
def test_empty_prompt(llm, gqa_checkpoint, tmp_path, capsys, empty):
    assert_api_fails_alone(llm, empty, "the prompt is empty")
    key = "prompt" if empty == "" else "prompt_token_ids"
    code, records, err, path = run_file(capsys, tmp_path, ['{"prompt": "ok"}', json.dumps({key: empty})],
                                        "--model", str(gqa_checkpoint), *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape(f"prompt 1 ({path}:2): the prompt is empty"))
    code, records, err = run(capsys, "ok", "", "--model", str(gqa_checkpoint), *SHORT)
    assert_fails_alone(code, records, err, 1, re.escape("prompt 1 (argument 2): the prompt is empty"))


def test_interrupt_keeps_finished_results_and_exits_with_one_line(gqa_checkpoint, tmp_path):
    """A real SIGINT (Ctrl-C) once two results are out: those stay printed, one line on stderr, exit 130. (Enough
    prompts that the run cannot end before the signal lands: 200 took about 3 s, and CI once saw it end first.)"""
    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(5000)))
    command = [sys.executable, "-m", "flash_dllm.cli", "generate", "--file", str(path), "--model",
               str(gqa_checkpoint), "--device", "cpu", "--batch-size", "1", "--method", "reference",
               "--max-tokens", "32", "--block-length", "8", "--json", "--no-progress"]
    # SIG_DFL in the child: a pytest started in the background (`cmd &`) ignores SIGINT, which exec passes on
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = [process.stdout.readline() for _ in range(2)]
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=120)
    lines += rest.splitlines(keepends=True)
    assert process.returncode == 130 and all(line.endswith("\n") for line in lines)
    assert [json.loads(line)["finish_reason"] for line in lines] == ["length"] * len(lines)
    assert err == f"flash-dllm: interrupted: {len(lines)} of 5000 requests finished\n"


# ----------------------------------------------------------------------------- errors of the call itself

def test_device_cuda_on_a_cpu_only_torch(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, "hi", "--device", "cuda")
    assert_one_line(code, err, re.escape("device 'cuda': this torch build sees no CUDA device"))


def test_config_json_without_vocab_size(tmp_path, capsys):
    config = {k: v for k, v in PRESETS["llada-tiny"].items() if k not in ("vocab_size", "embedding_size")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "hi", "--model", str(tmp_path))
    assert_one_line(code, err, "config.json: missing required key 'vocab_size'")


@pytest.mark.parametrize("flag, value, error", [
    ("--seed", str(2**64), re.escape(f"seed must be in [0, 2**63), got {2**64}")),
    ("--threshold", "1.5", re.escape("threshold must be in [0, 1], got 1.5")),
    ("--threshold", "-0.1", re.escape("threshold must be in [0, 1], got -0.1")),
    ("--threshold", "nan", "threshold must be finite, got nan"),
    ("--temperature", "inf", "temperature must be finite, got inf"),
    ("--kv-cache-bytes", "0", "kv_cache_bytes must hold at least one token's row of the KV cache, 18,432 bytes "
                              "for this model in float32, got 0"),
    ("--kv-cache-bytes", "-1", "kv_cache_bytes must hold .*, got -1"),
    ("--kv-cache-bytes", "1000", "kv_cache_bytes must hold .*, got 1,000"),
], ids=["seed-2**64", "threshold-1.5", "threshold-neg", "threshold-nan", "temperature-inf", "cache-0", "cache-neg",
        "cache-1000"])
def test_out_of_range_settings_on_the_command_line(capsys, flag, value, error):
    code, _, err = run(capsys, "hi", flag, value)  # the embedded model
    assert_one_line(code, err, error)


@pytest.mark.parametrize("kwargs, error", [
    (dict(max_tokens="32"), "max_tokens must be an integer, got '32' (str)"),
    (dict(seed=2**64), f"seed must be in [0, 2**63), got {2**64}"),
    (dict(threshold=1.5), "threshold must be in [0, 1], got 1.5"),
    (dict(threshold=-0.1), "threshold must be in [0, 1], got -0.1"),
    (dict(threshold=float("nan")), "threshold must be finite, got nan"),
    (dict(method="elastic", drift_threshold=1.5), "drift_threshold must be in [0, 1], got 1.5"),
    (dict(temperature=float("inf")), "temperature must be finite, got inf"),
], ids=["max_tokens-str", "seed-2**64", "threshold-1.5", "threshold-neg", "threshold-nan", "drift-1.5",
        "temperature-inf"])
def test_out_of_range_sampling_params(kwargs, error):
    with pytest.raises(ValueError) as caught:
        SamplingParams(**kwargs)
    assert str(caught.value) == error


@pytest.mark.parametrize("budget, error", [
    (0, "kv_cache_bytes must hold at least one token's row of the KV cache, 18,432 bytes for this model in "
        "float32, got 0"),
    (-1, "kv_cache_bytes must hold .*, got -1"),
    (1000, "kv_cache_bytes must hold .*, got 1,000"),
    (1.5, "kv_cache_bytes must be an integer, got 1.5 \\(float\\)"),
])
def test_kv_cache_bytes_in_the_api(budget, error):
    with pytest.raises(ValueError) as caught:
        LLM(device="cpu", kv_cache_bytes=budget)
    assert re.fullmatch(error, str(caught.value))


def test_nan_weights(tmp_path, capsys):
    model = random_model("llada-tiny", "cpu", torch.float32)
    model.layers[1].attention.o_proj.weight[0, :3] = float("nan")
    save_checkpoint(model, tmp_path, PRESETS["llada-tiny"])
    error = ("model.safetensors: tensor 'model.transformer.blocks.1.attn_out.weight' has NaN or inf values "
             "(3 as float32)")
    with pytest.raises(ValueError) as caught:
        LLM(str(tmp_path), device="cpu")
    assert str(caught.value) == error
    code, _, err = run(capsys, "hi", "--model", str(tmp_path))
    assert_one_line(code, err, re.escape(error))


def test_weights_that_overflow_the_dtype(tmp_path):
    model = random_model("llada-tiny", "cpu", torch.float32)
    model.embed.weight[7, 0] = 1e6  # finite in float32, inf in float16
    save_checkpoint(model, tmp_path, PRESETS["llada-tiny"])
    with pytest.raises(ValueError, match="tensor 'model.transformer.wte.weight' has NaN or inf values \\(1 as float16"):
        LLM(str(tmp_path), device="cpu", dtype="float16")


def test_logits_that_overflow_at_the_first_forward(tmp_path, capsys):
    """Finite weights whose activations overflow: the first forward's logits are checked once."""
    model = random_model("llada-tiny", "cpu", torch.float32)
    model.final_norm.weight.fill_(1e30)  # finite weights whose products overflow the logits to inf
    (model.lm_head or model.embed).weight.mul_(1e30)
    save_checkpoint(model, tmp_path, PRESETS["llada-tiny"])
    error = ("the model's logits at its first forward pass are not finite (NaN or inf): its activations "
             "overflow in float32")
    with pytest.raises(ValueError) as caught:
        LLM(str(tmp_path), device="cpu").generate([[5, 6, 7]], SamplingParams(max_tokens=8, block_length=8))
    assert str(caught.value) == error
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    code, _, err = run(capsys, "--file", str(prompts), "--model", str(tmp_path))
    assert_one_line(code, err, re.escape(error))


# ----------------------------------------------------------------------------- README examples run as written

def readme_blocks(language: str) -> list[str]:
    return re.findall(f"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_example_runs_on_the_embedded_model(capsys):
    """The API example with one change, the one its comment offers: LLM() (the embedded model) for the
    8B checkpoint on a GPU."""
    model = 'LLM("/models/LLaDA-8B-Instruct", device="cuda", dtype="bfloat16")  # or LLM() for the embedded model'
    (example,) = [block for block in readme_blocks("python") if model in block]
    exec(example.replace(model, "LLM()"), {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.split()[-1] in ("stop", "length") for line in lines)
    assert [line.split("####")[1].split("'")[0].strip() for line in lines] == ["12", "13", "20"]  # task-format prompts


def readme_generate_commands() -> list[tuple[list[str], str | None]]:
    """Every `flash-dllm generate` command of the README's bash blocks on the embedded model (no --model), of
    prompt arguments (no --file), with
    what `echo TEXT |` pipes into it."""
    commands, piped = [], None
    for block in readme_blocks("bash"):
        command, tokens = None, iter(shlex.split(block, comments=True))
        for token in tokens:
            if token == "flash-dllm":
                command = []
                commands.append((command, piped))
                piped = None
            elif token == "echo":  # echo TEXT | flash-dllm ...
                command, piped = None, next(tokens) + "\n"
            elif token in ("&&", ";", "|"):
                command = None
            elif command is not None:
                command.append(token)
    return [(c, stdin) for c, stdin in commands if c[0] == "generate" and "--model" not in c and "--file" not in c]


def test_readme_generate_commands_run_on_the_embedded_model(capsys, pipe_stdin):
    commands = readme_generate_commands()
    # quick start, the trace example, the piped one, the command-line section's first line, the wheel's
    assert [stdin is not None for _, stdin in commands] == [False, False, True, False, False]
    for command, stdin in commands:
        if stdin is not None:
            pipe_stdin(stdin.encode())
        assert main(command) == 0, command
        assert f"--- request 0 ({'argument 1' if stdin is None else 'stdin'}, " in capsys.readouterr().out

