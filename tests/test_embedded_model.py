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
    assert config["model_type"] == "llada" and config["max_sequence_length"] >= 8192
    assert config["vocab_size"] <= 4096


def test_parameter_count(llm):
    assert sum(p.numel() for p in llm.model.parameters()) <= 12_000_000


@pytest.mark.parametrize("length", [1024, 4096])
def test_decodes_held_out_passkey_items(llm, length):
    """Passkey retrieval is solved by the shipped model up to 8,000 tokens (100% on 100 items at 8,000 on the
    H200); here 2 items at 1,024 and 4,096."""
    items = [item for item in load_test_set("passkey") if item.length == length][:2]
    outs = llm.generate([item.prompt for item in items], SamplingParams(method="parallel", max_tokens=32))
    assert all(is_correct(item, out.text) for item, out in zip(items, outs))


def test_decodes_held_out_multikey_items(llm):
    """Multi-key retrieval (the asked label's key among 2-6 labelled keys): 90% at 512 tokens (CPU), 88% at
    2,048 and 78% at 8,000 (H200), 50 items each, run 9; here 8 items at 512."""
    items = [item for item in load_test_set("multikey") if item.length == 512][:8]
    outs = llm.generate([item.prompt for item in items], SamplingParams(method="parallel", max_tokens=32))
    assert sum(is_correct(item, out.text) for item, out in zip(items, outs)) >= 6


@pytest.mark.parametrize("task", ["arith", "trace"])
def test_decodes_held_out_items_one_token_per_step(llm, task):
    """Dual-cache solves 96% of arith and of trace (200 items each, run 9, as run 7); here the reference decoder
    on the first 5 (128 one-token steps: CI time)."""
    items = load_test_set(task)[:5]
    outs = llm.generate([item.prompt for item in items],
                        SamplingParams(method="reference", max_tokens=128, block_length=32))
    assert sum(is_correct(item, out.text) for item, out in zip(items, outs)) >= 4
    assert all(out.finish_reason == "stop" for out in outs)


def test_parallel_decodes_several_tokens_per_step(llm):
    items = load_test_set("arith")[:8]
    outs = llm.generate([item.prompt for item in items], SamplingParams(method="parallel", max_tokens=128))
    assert sum(len(o.token_ids) for o in outs) / sum(o.steps for o in outs) > 8
