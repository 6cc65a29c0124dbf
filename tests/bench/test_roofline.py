"""The roofline floor of a decoding iteration at LLaDA-8B dimensions."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.bench.roofline import floor_seconds, iteration_cost, weight_bytes_read
from flash_dllm.cache import KVCache
from flash_dllm.models import build_model
from flash_dllm.models.loader import random_config


def test_iteration_floor_llada_8b():
    cfg = random_config("llada-8b")
    weights = weight_bytes_read(build_model(cfg, "meta", torch.bfloat16))
    assert weights == (8_015_581_184 - 126464 * 4096) * 2  # all but the input embedding
    kv = KVCache.bytes_per_row(cfg, torch.bfloat16)
    # flash-cache at batch 1: 144 query rows, one pass over 768 keys; bound by the weight read
    memory, compute, floor = floor_seconds(*iteration_cost(cfg, 1, 768, 144, 1, weights, kv))
    assert floor == memory == pytest.approx(3.62e-3, rel=1e-2) and compute < memory
    # reference at batch 32: every one of 768 positions recomputed; bound by FLOPs
    memory, compute, floor = floor_seconds(*iteration_cost(cfg, 32, 768, 768, 1, weights, kv))
    assert floor == compute == pytest.approx(0.448, rel=1e-2) and compute > 50 * memory
