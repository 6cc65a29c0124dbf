"""The trained model shipped inside the package."""
from __future__ import annotations

import json

import pytest

from flash_dllm import LLM, SamplingParams
from flash_dllm.llm import default_model_path
from flash_dllm.tasks import is_correct, load_test_set


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def test_files_size_and_config():
    path = default_model_path()
    assert {p.name for p in path.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json", "generation_config.json"}
    assert (path / "model.safetensors").stat().st_size <= 24 * 10**6
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llada" and config["max_sequence_length"] >= 2048
    assert config["vocab_size"] <= 4096


def test_parameter_count(llm):
    assert sum(p.numel() for p in llm.model.parameters()) <= 12_000_000


def test_decodes_held_out_passkey_items(llm):
    """Passkey retrieval at 1024 tokens is solved by the shipped model (100% on 100 items on the H200)."""
    items = [item for item in load_test_set("passkey") if item.length == 1024][:3]
    outs = llm.generate([item.prompt for item in items], SamplingParams(method="parallel", max_tokens=128))
    assert all(is_correct(item, out.text) for item, out in zip(items, outs))


@pytest.mark.parametrize("task", ["arith", "trace"])
def test_decodes_held_out_items_one_token_per_step(llm, task):
    """The reference decoder solves 98.5% of arith and 92.5% of trace on the H200 (200 items each); here
    the first 8 (8 and 7 of them on the CPU)."""
    items = load_test_set(task)[:8]
    outs = llm.generate([item.prompt for item in items],
                        SamplingParams(method="reference", max_tokens=128, block_length=32))
    assert sum(is_correct(item, out.text) for item, out in zip(items, outs)) >= 6
    assert all(out.finish_reason == "stop" for out in outs)


def test_parallel_decodes_several_tokens_per_step(llm):
    items = load_test_set("arith")[:8]
    outs = llm.generate([item.prompt for item in items], SamplingParams(method="parallel", max_tokens=128))
    assert sum(len(o.token_ids) for o in outs) / sum(o.steps for o in outs) > 8
