"""SamplingParams: a knob is accepted only where something reads it."""
import pytest

from flash_dllm import SamplingParams
from flash_dllm.sampling_params import DEFAULT_KV_BUDGET


def test_kv_budget_without_routing_is_an_error():
    with pytest.raises(ValueError, match=r"^kv_budget \(0.5\) applies only with kv_routing"):
        SamplingParams(method="dual-cache", kv_budget=0.5)


def test_kv_budget_is_none_without_routing_and_defaults_with_it():
    assert SamplingParams(method="dual-cache").kv_budget is None
    assert SamplingParams(method="dual-cache").to_dict()["kv_budget"] is None
    assert SamplingParams(method="dual-cache", kv_routing="chunk").kv_budget == DEFAULT_KV_BUDGET
    assert SamplingParams(method="dual-cache", kv_routing="chunk", kv_budget=0.5).kv_budget == 0.5
