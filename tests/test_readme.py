"""README's examples that run on the embedded model give the answers they imply (issue 54, item 7).

Every question README puts to the embedded model is read from README.md itself: `flash-dllm generate` commands
without --model (prompt arguments, or a prompt piped in with echo) and the Python API snippet (run on the
embedded model, as its comment offers). A prompt counts as a question when it has a '?' (placeholders such as
"prompt one" are not). Its expected answer is computed here, not by the model's tasks: a word problem by reading
its sentences, a program by running it. Each command's question must be answered right by the command as written
and by both the default method and `reference`."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

import flash_dllm
from flash_dllm import LLM, SamplingParams
from flash_dllm.cli import build_parser, sampling_params_from_args
from flash_dllm.decoding.registry import DEFAULT_METHOD
from flash_dllm.tasks import extract_answer

README = (Path(__file__).parents[1] / "README.md").read_text()
PROGRAM = "What does this program print?\n"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


def shell_commands(block: str):
    """The words of each command of a bash block: a command runs to the end of its line (or past it inside
    quotes, as a multi-line prompt does), and is cut at `&&`, `;` and `|`, which stay as words."""
    lines, pending = block.replace("\\\n", " ").splitlines(), ""
    for line in lines:
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        pending, command = "", []
        for word in [*words, ";"]:
            if word in ("&&", ";", "|"):
                yield command, word
                command = []
            else:
                command.append(word)


def generate_commands() -> list[tuple[list[str], str | None]]:
    """(the arguments after `flash-dllm generate`, what echo pipes into it) of each command in README's bash
    blocks."""
    commands, echoed = [], None
    for block in code_blocks("bash"):
        for words, end in shell_commands(block):
            while words and re.fullmatch(r"\w+=\S*", words[0]):  # an environment variable's setting
                words = words[1:]
            if words[:2] == ["flash-dllm", "generate"]:
                commands.append((words[2:], echoed))
            echoed = " ".join(words[1:]) + "\n" if words[:1] == ["echo"] and end == "|" else None
    return commands


def word_problem(prompt: str) -> int:
    """The answer of a word problem in the arith task's sentences, read sentence by sentence."""
    counts = {}
    for sentence in re.findall(r"[^.?]+[.?]", prompt):
        sentence = sentence.strip()
        if m := re.fullmatch(r"(\w+) has (\d+) \w+\.", sentence):
            counts[m[1]] = int(m[2])
        elif m := re.fullmatch(r"(\w+) has (\d+) (more|fewer) \w+ than (\w+)\.", sentence):
            counts[m[1]] = counts[m[4]] + (int(m[2]) if m[3] == "more" else -int(m[2]))
        elif m := re.fullmatch(r"(\w+) has (\d+) times as many \w+ as (\w+)\.", sentence):
            counts[m[1]] = counts[m[3]] * int(m[2])
        elif m := re.fullmatch(r"(\w+) buys (\d+) more \w+\.", sentence):
            counts[m[1]] += int(m[2])
        elif m := re.fullmatch(r"(\w+) loses (\d+) \w+\.", sentence):
            counts[m[1]] -= int(m[2])
        elif m := re.fullmatch(r"(\w+) doubles the number of \w+\.", sentence):
            counts[m[1]] *= 2
        elif m := re.fullmatch(r"How many \w+ does (\w+) have now\?", sentence):
            return counts[m[1]]
        elif m := re.fullmatch(r"How many \w+ do (\w+) and (\w+) have together\?", sentence):
            return counts[m[1]] + counts[m[2]]
        else:
            raise AssertionError(f"README prompt {prompt!r}: {sentence!r} is not a sentence of the arith task")
    raise AssertionError(f"README prompt {prompt!r} asks no arith question")


def expected_answer(prompt: str) -> str:
    if prompt.startswith(PROGRAM):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(prompt.removeprefix(PROGRAM), {})
        return printed.getvalue().strip()
    return str(word_problem(prompt.strip()))


CASES = []  # (prompt, the command's SamplingParams) of each question README asks the embedded model
for arguments, stdin in generate_commands():
    args = build_parser().parse_args(["generate", *arguments])
    if args.model is None:
        CASES += [(prompt, sampling_params_from_args(args)) for prompt in args.prompts or [stdin] if "?" in prompt]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32")


def test_readme_shows_questions_for_the_embedded_model():
    assert len(CASES) >= 3 and any(prompt.startswith(PROGRAM) for prompt, _ in CASES)


@pytest.mark.parametrize("prompt, params", CASES, ids=[prompt[:60].replace("\n", " ") for prompt, _ in CASES])
def test_readme_command_answers(llm, prompt, params):
    """The command as written, and the same prompt with the default method and with reference, one at a time as
    a command runs it."""
    common = dict(max_tokens=params.max_tokens, block_length=params.block_length, temperature=params.temperature,
                  seed=params.seed)
    runs = {params.method: params} | {method: SamplingParams(method=method, **common)
                                      for method in (DEFAULT_METHOD, "reference") if method != params.method}
    expected = expected_answer(prompt)
    for method, run in runs.items():
        (out,) = llm.generate([prompt], run, use_tqdm=False)
        assert extract_answer(out.text) == expected, f"{method}: {out.text!r}"


class EmbeddedLLM:
    """The embedded model in place of the snippet's checkpoint; remembers the text of each prompt it encodes."""

    def __init__(self, llm: LLM):
        self.llm, self.texts = llm, {}

    def encode(self, prompt, **kwargs):
        ids = self.llm.encode(prompt, **kwargs)
        self.texts[tuple(ids)] = prompt
        return ids

    def generate(self, *args, **kwargs):
        return self.llm.generate(*args, **kwargs)


def test_readme_python_snippet_answers(llm, monkeypatch, capsys):
    (snippet,) = [block for block in code_blocks("python") if "LLM() for the embedded model" in block]
    embedded = EmbeddedLLM(llm)
    monkeypatch.setattr(flash_dllm, "LLM", lambda *args, **kwargs: embedded)  # the snippet's import reads it
    scope = {}
    exec(snippet, scope)
    assert len(capsys.readouterr().out.splitlines()) == len(scope["outputs"])
    for out in scope["outputs"]:
        prompt = out.prompt
        text = (prompt[-1]["content"] if isinstance(prompt[0], dict) else
                embedded.texts[tuple(prompt)] if isinstance(prompt[0], int) else prompt)
        assert extract_answer(out.text) == expected_answer(text), f"{text!r}: {out.text!r}"
