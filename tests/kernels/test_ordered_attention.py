"""Attention whose sums over keys run in one order (batch-invariant decoding): equal to PyTorch's attention within
fp32 rounding, and bit-identical however many padding keys follow a row's own; the scheduled reference in that
mode, verify passes and key mass included."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.cache.attention_metadata import AttentionMetadata, cu_seqlens
from flash_dllm.kernels.attention import ORDER_CHUNK, ordered_attention, ordered_sum, ragged_attention_ref


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_ordered_sum_ignores_trailing_zeros():
    x = torch.randn(3, 100)
    assert torch.allclose(ordered_sum(x, dim=1), x.sum(dim=1), atol=1e-5)
    assert torch.equal(ordered_sum(F.pad(x, (0, 333)), dim=1), ordered_sum(x, dim=1))


@pytest.mark.parametrize("keys", [5, ORDER_CHUNK, 300])
def test_matches_pytorch_attention(keys):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7 if i == 0 else keys, 16, generator=g) for i in range(3))
    visible = torch.rand(2, 1, 7, keys, generator=g) < 0.7
    visible[..., 0] = True
    out, probs = ordered_attention(q, k, v, visible)
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v, attn_mask=visible)) < 1e-5
    assert rel_err(probs, (q @ k.transpose(-1, -2) / 4).masked_fill(~visible, float("-inf")).softmax(-1)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trailing_padding_keys_change_no_bit(dtype):
    """A row's keys first, then any number of padding keys (the batch's longest row decides how many)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).to(dtype) for n in (9, 300, 300))
    visible = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    alone = ordered_attention(q, k, v, visible)
    for extra in (1, 50, 64, 700):
        junk = torch.randn(1, 2, extra, 32, generator=g).to(dtype)
        padded = ordered_attention(q, torch.cat([k, junk], 2), torch.cat([v, junk], 2), F.pad(visible, (0, extra)))
        assert torch.equal(padded[0], alone[0]) and torch.equal(padded[1][..., :300], alone[1])


def scheduled_pass(kv_lens, q_counts, verify: bool, seed: int = 0):
    """A pass over requests with these KV lengths and query rows (random cache, a verify pass optionally)."""
    g = torch.Generator().manual_seed(seed)
    B, N, heads, kv_heads, D = len(kv_lens), sum(q_counts), 4, 2, 16
    rows = sum(kv_lens) + 5
    q = torch.randn(N, heads, D, generator=g)
    k_cache, v_cache = torch.randn(rows, kv_heads, D, generator=g), torch.randn(rows, kv_heads, D, generator=g)
    starts = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0)[:-1].tolist()])
    options = dict(track_rows=torch.rand(N, generator=g) < 0.5)
    if verify:
        options.update(write_cache=False, hidden_keys=torch.rand(B, max(kv_lens), generator=g) < 0.3,
                       self_visibility=(torch.rand(B, max(q_counts), max(q_counts), generator=g) < 0.5)
                       | torch.eye(max(q_counts), dtype=torch.bool))
    table = AttentionMetadata(cu_seqlens_q=cu_seqlens(q_counts, "cpu"), kv_start=starts, kv_len=torch.tensor(kv_lens),
                              slot_mapping=torch.zeros(N, dtype=torch.long), max_q=max(q_counts),
                              max_kv=max(kv_lens), **options)
    new = (torch.randn(N, kv_heads, D, generator=g), torch.randn(N, kv_heads, D, generator=g)) if verify else ()
    return q, k_cache, v_cache, table, new


@pytest.mark.parametrize("verify", [False, True], ids=["cached", "verify"])
def test_scheduled_reference_in_order_matches_the_default(verify):
    q, k_cache, v_cache, table, new = scheduled_pass([30, 12, 90], [5, 9, 3], verify)
    results = []
    for ordered in (False, True):
        mass = None if verify else torch.zeros(3, table.max_kv)  # a verify pass tracks no mass
        table.ordered = ordered
        results.append((ragged_attention_ref(q, k_cache, v_cache, table, mass, *new), mass))
    (out_a, mass_a), (out_b, mass_b) = results
    assert rel_err(out_b, out_a) < 1e-5
    assert verify or rel_err(mass_b, mass_a) < 1e-5
