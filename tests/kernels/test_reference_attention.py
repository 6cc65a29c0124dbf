"""The scheduled attention's PyTorch reference, one request at a time in chunks of query rows: against a dense
per-request softmax in float64 (output and key mass, GQA, routed keys, the verify pass, both orders), the same
whatever its chunk size, and never a [rows, keys] tensor beyond its block for a long prompt."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_dllm.cache.attention_metadata import AttentionMetadata, cu_seqlens
from flash_dllm.kernels.attention import ordered_attention, ordered_attention_in_chunks, ragged_attention_ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not a.isnan().any() and not b.isnan().any()  # a NaN never passes
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_pass(q_counts, kv_lens, heads, kv_heads, dim, verify=False, routed=False, seed=0):
    """Random q, a flat cache with every request's range apart, the metadata (half the rows tracked) and the
    reference's optional arguments."""
    g = torch.Generator().manual_seed(seed)
    B, N = len(q_counts), sum(q_counts)
    bases, row = [], 3
    for length in kv_lens:
        bases.append(row)
        row += length + 5
    rand = lambda *shape: torch.randn(*shape, generator=g)
    q, k_cache, v_cache = rand(N, heads, dim), rand(row, kv_heads, dim), rand(row, kv_heads, dim)
    table = AttentionMetadata(cu_seqlens_q=cu_seqlens(q_counts, "cpu"), kv_start=torch.tensor(bases),
                              kv_len=torch.tensor(kv_lens), slot_mapping=torch.zeros(N, dtype=torch.long),
                              max_q=max(q_counts), max_kv=max(kv_lens), track_rows=torch.rand(N, generator=g) < 0.5)
    extra = {}
    if verify:  # every row sees itself, so that no row sees nothing
        table.write_cache = False
        table.hidden_keys = torch.rand(B, max(kv_lens), generator=g) < 0.3
        table.self_visibility = (torch.rand(B, max(q_counts), max(q_counts), generator=g) < 0.5) | torch.eye(
            max(q_counts), dtype=torch.bool)
        extra.update(k_new=rand(N, kv_heads, dim), v_new=rand(N, kv_heads, dim))
    if routed:
        extra["key_visible"] = torch.rand(B, kv_heads, max(kv_lens), generator=g) < 0.6
    return q, k_cache, v_cache, table, extra


def dense_reference(q, k_cache, v_cache, table, k_new=None, v_new=None, key_visible=None):
    """Each request alone in float64: out [N, H, D] and the tracked rows' mass over its cache keys [B, max_kv]."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    mass = torch.zeros(table.num_seqs, table.max_kv, dtype=torch.float64)
    cu = table.cu_seqlens_q.tolist()
    for b in range(table.num_seqs):
        first, end = cu[b], cu[b + 1]
        start, length = table.kv_start[b].item(), table.kv_len[b].item()
        keys, values = k_cache[start:start + length], v_cache[start:start + length]
        visible = torch.ones(end - first, length, dtype=torch.bool)
        if table.hidden_keys is not None:
            visible &= ~table.hidden_keys[b, :length]
        visible = visible[None].repeat(q.shape[1], 1, 1)                                       # [H, Q, K]
        if key_visible is not None:
            visible &= key_visible[b, :, :length].repeat_interleave(group, dim=0)[:, None]
        if k_new is not None:
            keys, values = torch.cat([keys, k_new[first:end]]), torch.cat([values, v_new[first:end]])
            own = table.self_visibility[b, :end - first, :end - first]
            visible = torch.cat([visible, own[None].expand(q.shape[1], -1, -1)], dim=2)
        kh = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
        vh = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q[first:end].double().transpose(0, 1) @ kh.transpose(1, 2) * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        out[first:end] = (probs @ vh).transpose(0, 1)
        tracked = table.track_rows[first:end]
        mass[b, :length] = probs[:, tracked, :length].sum(dim=(0, 1))
    return out, mass


CASES = {
    "ragged-gqa": ([5, 0, 17, 40], [30, 12, 77, 150], 4, 2, 32),  # a request with no rows
    "one-row": ([70, 1], [80, 5], 2, 1, 16),
    "long": ([200, 7], [600, 40], 4, 4, 32),
}


@pytest.mark.parametrize("ordered", [False, True], ids=["default", "ordered"])
@pytest.mark.parametrize("variant", ["cached", "routed", "verify"])
@pytest.mark.parametrize("case", CASES)
def test_matches_a_dense_softmax_in_any_chunks(case, variant, ordered):
    if ordered and variant == "routed":
        pytest.skip("routed keys are not batch-invariant")
    q, k_cache, v_cache, table, extra = make_pass(*CASES[case], verify=variant == "verify",
                                                  routed=variant == "routed")
    table.ordered = ordered
    expected_out, expected_mass = dense_reference(q, k_cache, v_cache, table, **extra)
    for block_bytes in (64 << 20, 1 << 16):  # one block, or chunks of a few rows
        mass = torch.zeros(table.num_seqs, table.max_kv)
        out = ragged_attention_ref(q, k_cache, v_cache, table, mass, block_bytes=block_bytes, **extra)
        assert rel_err(out, expected_out) < 1e-5
        assert rel_err(mass, expected_mass) < 1e-5


def test_rows_that_see_no_key_get_zeros_and_no_mass():
    q, k_cache, v_cache, table, _ = make_pass([3, 2], [0, 6], 2, 2, 16)
    table.track_rows[:] = True
    mass = torch.zeros(2, 6)
    out = ragged_attention_ref(q, k_cache, v_cache, table, mass)
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and mass[0].abs().sum() == 0
    assert torch.allclose(mass[1].sum(), torch.tensor(2.0 * 2))  # 2 tracked rows x 2 heads, each summing to 1


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates under it."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("ordered", [False, True], ids=["default", "ordered"])
def test_a_long_prompt_never_holds_its_scores(ordered):
    """A first pass of 1,024 rows over 1,024 keys: no tensor of [H, rows, keys] (2M elements here) is created,
    and the key mass (every row tracked) and output are the same in small blocks as in one."""
    q, k_cache, v_cache, table, _ = make_pass([1024], [1024], 2, 2, 16)
    table.ordered, table.track_rows[:] = ordered, True
    whole_mass, mass = torch.zeros(1, 1024), torch.zeros(1, 1024)
    whole = ragged_attention_ref(q, k_cache, v_cache, table, whole_mass, block_bytes=1 << 30)
    block_bytes = 1 << 20  # an eighth of the scores
    with LargestTensor() as largest:
        out = ragged_attention_ref(q, k_cache, v_cache, table, mass, block_bytes=block_bytes)
    assert largest.numel * 4 <= 2 * block_bytes  # (the ordered mass's running sum rides with a chunk's rows)
    assert rel_err(out, whole) < 1e-6 and rel_err(mass, whole_mass) < 1e-6


def test_ordered_attention_in_chunks_is_ordered_attention():
    """Chunks of query rows change no bit of a row (equal chunks: no short last one)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (200, 300, 300))
    visible = torch.rand(2, 1, 200, 300, generator=g) < 0.8
    whole = ordered_attention(q, k, v, visible)[0]
    assert torch.equal(ordered_attention_in_chunks(q, k, v, visible, block_bytes=2 * 3 * 320 * 4 * 40), whole)
