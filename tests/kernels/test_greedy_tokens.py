"""Greedy tokens and confidences against the sampler's PyTorch path (kernels/greedy_tokens.py)."""
from kernel_testing import DEVICE  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.kernels.greedy_tokens import BLOCK_V, greedy_tokens, greedy_tokens_ref

SPLIT = 2 * BLOCK_V  # small splits: several per row on the CPU


def make_logits(rows, vocab, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 4.0 * torch.randn(rows, vocab, generator=g)
    logits[0, 7] = logits[0, vocab - 3] = logits[0].max() + 1.0      # a tie across splits: the first index wins
    logits[1, 5] = logits[1].max() + 50.0                             # the mask id is the largest logit
    logits[2, 100:110] = logits[2].max() + 2.0                        # a tie inside one lane block
    return logits.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [3 * SPLIT - 5, SPLIT + 1, 300])
def test_matches_reference(vocab, dtype):
    logits = make_logits(5, vocab, dtype)
    tokens, confidence = greedy_tokens(logits, mask_id=5, split_size=SPLIT)
    ref_tokens, ref_confidence = greedy_tokens_ref(logits, mask_id=5)
    assert torch.equal(tokens, ref_tokens)
    assert tokens[0] == 7 and tokens[1] != 5 and tokens[2] == 100
    assert confidence.dtype == torch.float64 and not confidence.isnan().any()
    assert ((confidence - ref_confidence).abs() / ref_confidence).max() < 1e-13


def test_rows_do_not_depend_on_the_batch():
    logits = make_logits(6, 3 * SPLIT)
    tokens, confidence = greedy_tokens(logits, mask_id=5, split_size=SPLIT)
    alone = greedy_tokens(logits[3:4], mask_id=5, split_size=SPLIT)
    assert torch.equal(alone[0], tokens[3:4]) and torch.equal(alone[1], confidence[3:4])


def test_no_rows():
    tokens, confidence = greedy_tokens(make_logits(3, 300)[:0], mask_id=5)
    assert tokens.shape == confidence.shape == (0,)
