"""The sampler: Gumbel-max draws and softmax confidences, the same numbers whether a batch's requests are taken
at once or in chunks (its working memory)."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.decoding import sampling
from flash_dllm.decoding.sampling import sample_tokens


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_chunks_of_requests_give_the_numbers_of_the_whole_batch(monkeypatch, sample):
    g = torch.Generator().manual_seed(0)
    B, n, V = 7, 4, 50
    logits = torch.randn(B, n, V, generator=g)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.3, 0.0, 2.0, 0.5])
    seed, step = torch.arange(B) * 11, torch.arange(B) + 3
    column = torch.arange(n).expand(B, n) + 5
    whole = sample_tokens(logits, temperature, seed, step, column, sample, mask_id=2)
    monkeypatch.setattr(sampling, "CHUNK_BYTES", 3 * n * V * 8)  # three requests a chunk: 3 + 3 + 1
    chunked = sample_tokens(logits, temperature, seed, step, column, sample, mask_id=2)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert not (whole[0] == 2).any()  # the mask token is never a candidate
    probs = torch.softmax(logits.double(), dim=-1)
    assert torch.equal(whole[1], probs.gather(-1, whole[0][..., None]).squeeze(-1))
    if not sample:
        assert torch.equal(whole[0], logits.index_fill(-1, torch.tensor([2]), float("-inf")).argmax(dim=-1))
