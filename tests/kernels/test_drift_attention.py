"""The drift test's attention (Elastic-Cache) against its PyTorch reference: GQA, keys anywhere in the cache,
invalid keys, key counts across tiles, both cache dtypes (the math is fp32 either way)."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.kernels.drift_attention import drift_attention, drift_attention_ref

# (requests, query rows, heads, kv heads, head_dim, keys)
CASES = {"gqa": (2, 5, 4, 2, 32, 70), "one-key-tile": (3, 1, 2, 2, 16, 9),
         "dream-head": (1, 28, 7, 1, 128, 40), "mha-llada": (2, 32, 4, 4, 128, 130)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype):
    B, T, H, kv_heads, D, K = CASES[case]
    g = torch.Generator().manual_seed(0)
    rows = B * K + 7
    q = torch.randn(B, T, H, D, generator=g).to(dtype).to(DEVICE)
    k_cache = torch.randn(rows, kv_heads, D, generator=g).to(dtype).to(DEVICE)
    key_slot = torch.randperm(rows, generator=g)[:B * K].view(B, K).to(DEVICE)  # anywhere, in any order
    key_valid = torch.rand(B, K, generator=g) < 0.8
    key_valid[:, 0] = True
    key_valid = key_valid.to(DEVICE)
    expected = drift_attention_ref(q, k_cache, key_slot, key_valid)
    got = drift_attention(q, k_cache, key_slot, key_valid)
    assert got.shape == (B, H, T, K) and got.dtype == torch.float32
    assert rel_err(got, expected) < BUDGET[torch.float32]
    assert (got[~key_valid[:, None, None, :].expand_as(got)] == 0).all()


def test_a_request_with_no_valid_key_gets_zeros():
    q = torch.randn(1, 2, 2, 16).to(DEVICE)
    k_cache = torch.randn(4, 2, 16).to(DEVICE)
    got = drift_attention(q, k_cache, torch.arange(4, device=DEVICE)[None], torch.zeros(1, 4, dtype=torch.bool,
                                                                                          device=DEVICE))
    assert torch.equal(got, torch.zeros_like(got))
