"""What a new user hits in their first hour, second round (issue 54), each case with the input as the issue wrote
it: a one-line message naming the culprit and the fix, given before any work (no model loaded), or the behaviour
asked for. README's examples are checked in test_readme.py."""
from __future__ import annotations

import argparse
import importlib
import runpy
import sys

import pytest

from flash_dllm import SamplingParams
from flash_dllm.cli import build_parser, default_demo_methods, demo_items, main
from flash_dllm.extras import MissingExtra, require_extra


def one_line(err: str, prefix: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model is an error that names itself: a command that gets that far did work first."""
    def load(*args, **kwargs):
        raise ValueError("the model was loaded")
    monkeypatch.setattr("flash_dllm.cli.llm_from_args", load)


def hide(monkeypatch, *modules: str):
    """As if the modules were not installed: find_spec finds nothing, an import fails."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


# 2. A missing extra: `flash-dllm serve`, `bench serve`, `sweep`, `python -m flash_dllm.eval.lm_eval_adapter`

def test_require_extra_names_the_extra_and_the_missing_modules(monkeypatch):
    require_extra("serve", "flash-dllm serve", "fastapi", "uvicorn")  # installed: nothing happens
    hide(monkeypatch, "fastapi", "uvicorn")
    with pytest.raises(MissingExtra, match=r"^flash-dllm serve needs the serve extra: pip install 'flash-dllm\[serve\]' "
                                           r"\(missing: fastapi, uvicorn\)$"):
        require_extra("serve", "flash-dllm serve", "fastapi", "uvicorn")
    assert issubclass(MissingExtra, ModuleNotFoundError)


@pytest.mark.parametrize("argv, user, extra, missing", [
    (["serve", "--port", "0"], "flash-dllm serve", "serve", "fastapi"),
    (["bench", "serve", "--duration", "1"], "flash-dllm bench serve", "serve", "httpx"),
    (["sweep", "--task", "arith", "--methods", "parallel", "--threshold", "0.9"], "flash-dllm sweep", "eval",
     "matplotlib"),
    (["eval", "--task", "math500"], "task math500", "eval", "math_verify"),
], ids=["serve", "bench-serve", "sweep", "eval-math500"])
def test_missing_extra_is_one_line_before_any_work(argv, user, extra, missing, monkeypatch, no_model, tmp_path,
                                                   capsys):
    hide(monkeypatch, missing)
    monkeypatch.chdir(tmp_path)  # sweep writes into ./sweep: nothing may appear
    assert main(argv) == 2
    one_line(capsys.readouterr().err, f"flash-dllm: error: {user} needs the {extra} extra: pip install "
                                      f"'flash-dllm[{extra}]' (missing: {missing})")
    assert not any(tmp_path.iterdir())


def test_lm_eval_adapter_without_lm_eval(monkeypatch, capsys):
    hide(monkeypatch, "lm_eval")
    monkeypatch.delitem(sys.modules, "flash_dllm.eval.lm_eval_adapter", raising=False)
    message = ("flash_dllm.eval.lm_eval_adapter needs the lm-eval extra: pip install 'flash-dllm[lm-eval]' "
               "(missing: lm_eval)")
    with pytest.raises(SystemExit) as done:  # python -m flash_dllm.eval.lm_eval_adapter
        runpy.run_module("flash_dllm.eval.lm_eval_adapter", run_name="__main__")
    assert done.value.code == 2
    assert one_line(capsys.readouterr().err, "error: ") == f"error: {message}"
    with pytest.raises(MissingExtra, match="needs the lm-eval extra"):  # imported from Python
        importlib.import_module("flash_dllm.eval.lm_eval_adapter")


# 4. `flash-dllm eval --task math500` without math-verify (above; evaluate's own check in eval/test_harness.py);
# the embedded model on a task it never learnt

@pytest.mark.parametrize("command", ["eval", "sweep"])
def test_embedded_model_on_a_foreign_task_warns_up_front(command, no_model, capsys):
    argv = [command, "--task", "gsm8k"] + (["--methods", "parallel"] if command == "sweep" else [])
    assert main(argv) == 2
    warning, error = capsys.readouterr().err.splitlines()  # the warning, then the load (refused here)
    assert warning == ("flash-dllm: warning: this embedded model was trained only on arith, trace, passkey, multikey; "
                       "gsm8k will score near 0: load a real checkpoint with --model")
    assert error == "flash-dllm: error: the model was loaded"


def test_the_embedded_llada2_model_warns_of_its_own_tasks(no_model, capsys):
    assert main(["eval", "--task", "passkey", "--model", "embedded:llada2"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "flash-dllm: warning: this embedded model was trained only on arith, trace; passkey will score near 0: load a "
        "real checkpoint with --model")


@pytest.mark.parametrize("argv", [["eval", "--task", "arith"], ["eval", "--task", "gsm8k", "--model", "/models/x"]],
                         ids=["own-task", "another-model"])
def test_no_warning_for_the_embedded_models_tasks_or_another_model(argv, no_model, capsys):
    assert main(argv) == 2
    one_line(capsys.readouterr().err, "flash-dllm: error: the model was loaded")


# 5. `top_p=0.5` with the default method

def test_a_setting_of_another_method_names_the_method_that_reads_it(no_model, capsys):
    with pytest.raises(ValueError) as api:
        SamplingParams(top_p=0.5)
    assert str(api.value) == "top_p applies to method dream, not 'parallel'"
    assert main(["generate", "x", "--top-p", "0.5"]) == 2
    assert one_line(capsys.readouterr().err, "flash-dllm: error: ") == f"flash-dllm: error: {api.value}"


# 6. `flash-dllm demo`: several items per task, a compact table, an example answer beside the expected one

def test_demo_defaults_to_several_items_per_task():
    args = build_parser().parse_args(["demo"])
    assert {task: len(items) for task, items in demo_items(args).items()} == {task: args.items for task in args.tasks}
    assert args.items > 1 and set(args.tasks) == {"arith", "trace", "passkey"}
    assert args.methods is None  # the rows the model admits: resolved once it loads
    llada2 = build_parser().parse_args(["demo", "--model", "embedded:llada2"])
    assert list(demo_items(llada2)) == ["arith", "trace"]  # the tasks that model was trained on
    assert "reference" in default_demo_methods() and "parallel" in default_demo_methods()


def test_demo_output(capsys):
    assert main(["demo", "--device", "cpu", "--items", "2", "--tasks", "arith", "--methods", "parallel"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("Correct answers to 2 held-out items per task; forward passes (NFE)")
    header, rule, row = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:4])
    assert header == ["method", "arith", "NFE", "tokens/step", "query rows/step", "tokens/s"]
    assert row[0] == "parallel" and row[1] in ("0/2", "1/2", "2/2") and float(row[-1]) > 0
    assert lines[4] == "" and lines[5].startswith("parallel on arith #0: ") and "(expected " in lines[5]
    assert lines[6].startswith("prompt: ") and lines[7].startswith("answer: ") and "####" in lines[7]
    assert "Not run by default" not in captured.out  # the user chose the methods
    assert one_line(captured.err, "parallel: arith ").endswith(" s)")


def test_demo_checks_prompt_length_before_loading(no_model, capsys):
    assert main(["demo", "--tasks", "passkey", "--prompt-length", "300"]) == 2
    one_line(capsys.readouterr().err, "flash-dllm: error: --prompt-length 300: passkey has items of 256, 512")


# 7. Every flag says what it does (--no-progress had no help)

def subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {inner}", p) for inner, p in subcommands(sub))


def test_every_flag_has_help():
    missing = [f"{name} {action.option_strings[0]}" for name, sub in subcommands(build_parser())
               for action in sub._actions if action.option_strings and not action.help]
    assert missing == []
