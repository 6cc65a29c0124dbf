"""The running batch: rows of different lengths stacked left-padded with their counters and the method's
per-position state, and handed back unchanged."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dllm import SamplingParams
from flash_dllm.batch import Counters, DecodeBatch, RowState


@dataclass
class State:
    mass: torch.Tensor


def row(tokens: list[int], threshold: float, steps: int) -> RowState:
    counters = Counters.zeros("cpu")
    counters.steps += steps
    params = SamplingParams(threshold=threshold, max_tokens=2, block_length=2)
    return RowState(params=params, prompt_length=len(tokens) - 2, tokens=torch.tensor(tokens), counters=counters,
                    state=State(torch.arange(len(tokens)) + 1.0), cache_base=None)


def test_build_pads_left_and_unpack_hands_rows_back():
    rows = [row([7, 8, 9, 3, 3], 0.9, 2), row([5, 3, 3], 0.6, 0)]
    batch = DecodeBatch.build(rows, mask_id=3, stop_ids=torch.tensor([1]), pad_id=1)
    assert batch.tokens.tolist() == [[7, 8, 9, 3, 3], [1, 1, 5, 3, 3]]
    assert batch.attention_mask.tolist() == [[True] * 5, [False, False, True, True, True]]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]
    assert batch.state.mass.tolist() == [[1, 2, 3, 4, 5], [0, 0, 1, 2, 3]]
    assert batch.counters.steps.tolist() == [2, 0] and batch.rule_value.tolist() == [0.9, 0.6]
    assert (batch.gen_start, batch.cache_base) == (3, None)

    batch.tokens[1, 3] = 42
    batch.state.mass += 10
    batch.counters.steps += 1
    batch.unpack(keep=[False, True])
    assert rows[0].tokens.tolist() == [7, 8, 9, 3, 3] and rows[0].counters.steps.item() == 2  # not kept
    assert rows[1].tokens.tolist() == [5, 42, 3] and rows[1].state.mass.tolist() == [11, 12, 13]
    assert rows[1].counters.steps.item() == 1
