"""Elastic-Cache's drift test kernel against its PyTorch reference, also from an fp8 cache."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.kernels.drift_cosine import drift_cosine, drift_cosine_ref, key_splits
from flash_dllm.kernels.fp8 import quantize_rows_ref


def make_inputs(dtype, tracked=5, lengths=(7, 70, 130), width=140, heads=4, kv_heads=2, head_dim=32, rewritten=9,
                seed=0):
    """A cache of three requests laid out with gaps; `rewritten` query rows per request whose keys the layer
    rewrote (their old keys in old_keys); keys scaled so that the softmaxes are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    lengths_t = torch.tensor(lengths)
    base = torch.cumsum(torch.tensor([0, *lengths[:-1]]) + 3, 0)
    k_cache = 2.0 * torch.randn(int(base[-1]) + width, kv_heads, head_dim, generator=g)
    q_before, q_after = (torch.randn(B, tracked, heads, head_dim, generator=g) for _ in range(2))
    before_row = torch.full((B, width), -1, dtype=torch.long)
    old_keys = []
    for b, length in enumerate(lengths):
        positions = torch.randperm(length, generator=g)[:rewritten]
        before_row[b, positions] = torch.arange(len(old_keys), len(old_keys) + len(positions))
        old_keys += [2.0 * torch.randn(kv_heads, head_dim, generator=g) for _ in positions]
    to = lambda t: t.to(DEVICE, dtype)
    return (to(q_before), to(q_after), to(k_cache), base.to(DEVICE), lengths_t.to(DEVICE), before_row.to(DEVICE),
            to(torch.stack(old_keys)))


def fp8_inputs(q_before, q_after, k_cache, base, lengths, before_row, old_keys) -> tuple[tuple, dict]:
    """make_inputs' with the cache's keys and the old keys in E4M3, and their scales as keyword arguments."""
    (k_values, k_scale), (old_values, old_scale) = quantize_rows_ref(k_cache), quantize_rows_ref(old_keys)
    return ((q_before, q_after, k_values, base, lengths, before_row, old_values),
            dict(k_scale=k_scale, old_scale=old_scale))


@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tracked", [5, 70], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("splits", [1, 3, None], ids=lambda s: f"splits{s}")
def test_drift_cosine_matches_reference(dtype, tracked, splits, fp8):
    """Also with the keys split across programs (the 7-key request leaves two of three splits empty), and with
    the split count the kernel picks; written into a given slice (the reuse pass's per-layer buffer)."""
    inputs, scales = make_inputs(dtype, tracked=tracked), {}
    if fp8:
        inputs, scales = fp8_inputs(*inputs)
    layers = torch.full((2, 3, 4, tracked), float("nan"), device=DEVICE)
    out = drift_cosine(*inputs, splits=splits, out=layers[1], **scales)
    assert out.data_ptr() == layers[1].data_ptr() and layers[0].isnan().all()
    expected = drift_cosine_ref(*inputs, **scales)
    assert out.shape == expected.shape == (3, 4, tracked)
    assert rel_err(out, expected) < BUDGET[dtype]
    assert rel_err(1.0 - out, 1.0 - expected) < BUDGET[dtype] * 10  # the drift itself, not only the cosine's 1


def test_unchanged_keys_and_queries_have_no_drift():
    q, _, k_cache, base, lengths, before_row, old_keys = make_inputs(torch.float32)
    cosine = drift_cosine(q, q, k_cache, base, lengths, torch.full_like(before_row, -1), old_keys)
    assert torch.allclose(cosine, torch.ones_like(cosine), atol=1e-6)


def test_a_rewritten_key_is_read_from_the_old_keys():
    """With the same queries, only the rewritten keys make the two distributions differ."""
    q, _, k_cache, base, lengths, before_row, old_keys = make_inputs(torch.float32)
    cosine = drift_cosine(q, q, k_cache, base, lengths, before_row, old_keys)
    assert cosine.mean() < 0.99
    assert rel_err(cosine, drift_cosine_ref(q, q, k_cache, base, lengths, before_row, old_keys)) < 1e-5


def test_keys_split_only_where_programs_are_few():
    assert key_splits(32, 768) == 9          # batch 1, 32 heads: about two programs per SM (132)
    assert key_splits(32 * 32, 768) == 1     # batch 32 fills the GPU alone
    assert key_splits(32, 100) == 2          # never more splits than key tiles
