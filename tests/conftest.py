"""Fixtures: tiny checkpoints in the real Hugging Face LLaDA format (config.json, safetensors shards +
index, tokenizer.json + tokenizer_config.json), written to a temporary directory."""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest

# The Triton interpreter's tl.dot is numpy's matmul: OpenBLAS's Haswell sgemm kernel (the one this machine's
# environment picks with OPENBLAS_CORETYPE=Haswell; its AVX-512 one too) rounds a row by its place in the tile
# (OpenBLAS 0.3.31: 34 of 64 rows of a 64x32 @ 32x64 product), which the bit-identity tests of the invariant kernels
# see as batch dependence; its SSE3 kernel (Prescott) does not. Read when numpy loads, so before torch.
os.environ["OPENBLAS_CORETYPE"] = "Prescott"
# Under pytest-xdist (-n N) the workers share the cores: each takes its share of threads (torch's, and OpenBLAS's for
# the interpreter's tl.dot), and so do the processes it starts. Oversubscribed, a worker's idle OpenMP threads spin
# and starve the other (2 workers of 2 threads on 2 cores: 3x slower). Read when numpy and torch load.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run under the interpreter; read when a kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_dllm import LLM  # noqa: E402
from flash_dllm.config import PRESETS
from flash_dllm.engine import model_runner
from flash_dllm.models import random_model, save_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from llada_tokenizer import train_llada_tokenizer  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tom has 3 apples and buys 4 more. How many apples does he have? 3 + 4 = 7. #### 7",
    "x = 5\nfor i in range(3):\n    x = x + i\nprint(x)",
    "The passkey is 48213. Remember it. What is the passkey?",
] * 20


# Cached method -> (its settings that make it exact, the decoding it then equals): the equivalence tests' table
EXACT = {
    "prefix-cache": (dict(refresh_interval=1), dict(method="parallel")),
    "dual-cache": (dict(refresh_interval=1), dict(method="parallel")),
    "flash-cache": (dict(tracking_budget=200, mask_window=32), dict(method="parallel")),
    "flash-verify": (dict(tracking_budget=6, mask_window=8, verify_threshold=1.0),
                     dict(method="flash-cache", tracking_budget=6, mask_window=8)),
}


def eos_biased_llm(path: Path, **kwargs) -> LLM:
    """An fp32 CPU LLM on a random checkpoint whose eos logit is scaled up, so that some requests stop
    early and the early-stop path is exercised."""
    llm = LLM(str(path), **{"device": "cpu", "dtype": "float32", **kwargs})
    llm.model.lm_head.weight[llm.special.stop_ids[0]] *= 2.5
    return llm


def tiny_config(**overrides) -> dict:
    """A LLaDA config.json for a model small enough to run many decodes in a test."""
    return {**PRESETS["llada-tiny"], **overrides}


def write_checkpoint(path: Path, config: dict, num_shards: int = 2, with_tokenizer: bool = True,
                     seed: int = 0, std: float = 0.3) -> Path:
    """Random weights (std large enough that confidences are far from flat) saved as a checkpoint."""
    model = random_model(str(_config_dir(path, config)), "cpu", torch.float32, seed=seed, std=std)
    save_checkpoint(model, path, config, num_shards=num_shards)
    if with_tokenizer:
        train_llada_tokenizer(CORPUS, config["vocab_size"], path)
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return path


def _config_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


# The KV cache's default on the CPU is 40% of MemAvailable up to 1 GiB, zeroed when a cached method first runs (Elastic-
# Cache's hidden states beside it): every LLM of a test would touch a GiB or more (test_batch_invariant.py's prefix-cache
# and elastic cases: 8.7 GB resident, 21 of their 33 s in the kernel's page faults), two test workers at once on CI's
# 24 GB. The tests' LLMs that give no kv_cache_bytes get at most this: 14,500 rows of the embedded model in fp32,
# half a million of the tiny models'. Processes that a test starts keep the real default.
TEST_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="session", autouse=True)
def small_default_kv_cache():
    default = model_runner.default_cache_budget
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "default_cache_budget", lambda device: min(default(device), TEST_CACHE_BYTES))
        yield


@pytest.fixture(scope="session")
def mha_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("mha"), tiny_config(n_kv_heads=4))


@pytest.fixture(scope="session")
def gqa_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("gqa"), tiny_config(n_kv_heads=2))


@pytest.fixture(scope="session")
def bias_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bias"), tiny_config(include_bias=True), num_shards=1)


@pytest.fixture(scope="session", params=["mha", "gqa"])
def checkpoint(request, mha_checkpoint, gqa_checkpoint) -> Path:
    return {"mha": mha_checkpoint, "gqa": gqa_checkpoint}[request.param]


class _Piped(io.TextIOWrapper):
    """Standard input with `data` piped in (not a terminal)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data), encoding="utf-8")

    def isatty(self) -> bool:
        return False


@pytest.fixture
def pipe_stdin(monkeypatch):
    """pipe_stdin(data): the process's standard input becomes `data` piped in."""
    return lambda data: monkeypatch.setattr("sys.stdin", _Piped(data))
