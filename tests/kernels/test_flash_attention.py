"""Scheduled flash attention against ragged_attention_ref: ragged batches, GQA, key mass, the verify pass, each
with the keys of a request in one program and split across several (merged after the launch), and from an fp8
cache (the reference dequantises it). GQA cases run packed (one program per KV head, the default) and, in
test_gqa_packed_and_per_head_match_reference, also one program per query head."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.cache.attention_metadata import AttentionMetadata, cu_seqlens
from flash_dllm.kernels.attention import ragged_attention_ref
from flash_dllm.kernels.flash_attention import (ROUTED_BLOCK_N, TARGET_PROGRAMS, flash_attention, launch_config,
                                                num_splits, routed_keys)
from flash_dllm.kernels.fp8 import FP8, quantize_rows_ref

# (query rows per request, KV length per request, heads, kv heads, head_dim)
CASES = {
    "ragged-gqa": ([5, 0, 17, 40], [30, 12, 77, 150], 4, 2, 32),  # a request with no rows; 3 key tiles
    "head-dim-24": ([3, 9], [9, 20], 2, 2, 24),                  # head_dim not a power of two
    "two-query-tiles": ([70, 1], [80, 5], 2, 1, 16),
    "eight-requests": ([66, 3, 0, 70, 5, 1, 2, 9], [10, 4, 0, 80, 3, 2, 1, 20], 2, 1, 16),  # verify's 128-row tiles
    "head-dim-128": ([70, 3], [150, 40], 2, 1, 128),  # LLaDA-8B's head size: fp32 tiles must fit the GPU's smem
    "dream-gqa-7": ([9, 33], [40, 70], 7, 1, 128),    # Dream-7B's groups: 7 query heads per KV head (28 / 4)
}
DTYPES = [torch.float32, torch.bfloat16]
SPLITS = [1, 3]  # 3: some splits of the shorter requests hold no key
# Splitting does not depend on the dtype: 3 splits in fp32 only (the interpreted kernels are slow on the CPU); an
# fp8 cache (kv FP8) with a bf16 model unsplit and an fp32 one split.
DTYPE_SPLITS = [(torch.float32, 1, None), (torch.bfloat16, 1, None), (torch.float32, 3, None),
                (torch.bfloat16, 1, FP8), (torch.float32, 3, FP8)]
IDS = ["fp32", "bf16", "fp32-split", "bf16-fp8-cache", "fp32-split-fp8-cache"]


def make_batch(q_counts, kv_lens, heads, kv_heads, head_dim, dtype, verify=False, seed=0):
    """Random q, a flat cache holding every request's range (anywhere, in any order) and the block table."""
    g = torch.Generator().manual_seed(seed)
    B, N = len(q_counts), sum(q_counts)
    order = torch.randperm(B, generator=g).tolist()
    bases, row = [0] * B, 3
    for b in order:
        bases[b], row = row, row + kv_lens[b] + 2
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    q, k_cache, v_cache = rand(N, heads, head_dim), rand(row, kv_heads, head_dim), rand(row, kv_heads, head_dim)
    max_q, max_kv = max(q_counts), max(kv_lens)
    table = AttentionMetadata(cu_seqlens_q=cu_seqlens(q_counts, DEVICE), kv_start=torch.tensor(bases, device=DEVICE),
                       kv_len=torch.tensor(kv_lens, device=DEVICE),
                       slot_mapping=torch.zeros(N, dtype=torch.long, device=DEVICE),  # no cache write here
                       max_q=max_q, max_kv=max_kv, track_rows=(torch.rand(N, generator=g) < 0.5).to(DEVICE))
    if verify:  # every row sees itself, as in Flash-Verify, so that no row sees nothing
        table.write_cache = False
        table.hidden_keys = (torch.rand(B, max_kv, generator=g) < 0.3).to(DEVICE)
        visible = (torch.rand(B, max_q, max_q, generator=g) < 0.5) | torch.eye(max_q, dtype=torch.bool)
        table.self_visibility = visible.to(DEVICE)
    return q, k_cache, v_cache, table


def stored(k_cache, v_cache, kv):
    """The cache as stored: K, V as made (kv None), or quantised to E4M3 (kv FP8); and the scales as keyword
    arguments."""
    if kv is None:
        return k_cache, v_cache, {}
    (k_values, k_scale), (v_values, v_scale) = quantize_rows_ref(k_cache), quantize_rows_ref(v_cache)
    return k_values, v_values, dict(k_scale=k_scale, v_scale=v_scale)


def mass_budget(dtype, kv) -> float:
    """fp32 probabilities from exact products, whatever the input dtype; from an fp8 cache the reference rounds the
    dequantised keys to the dtype, which the kernel (scaling scores) does not."""
    return 1e-5 if kv is None else BUDGET[dtype]


def new_keys_and_values(q, k_cache, seed=1):
    """The verify pass's own K, V [N, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(q.shape[0], *k_cache.shape[1:], generator=g).to(q.dtype).to(DEVICE) for _ in range(2))


@pytest.mark.parametrize("dtype, splits, kv", DTYPE_SPLITS, ids=IDS)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype, splits, kv):
    q, k_cache, v_cache, table = make_batch(*CASES[case], dtype)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    out = flash_attention(q, k_cache, v_cache, table, splits=splits, **scales)
    assert rel_err(out, ragged_attention_ref(q, k_cache, v_cache, table, **scales)) < BUDGET[dtype]


@pytest.mark.parametrize("case", CASES)
def test_fp8_cache_is_close_to_the_unquantised_attention(case):
    """E4M3's 3-bit mantissa, one scale per key and KV head: the bf16 attention's output in direction."""
    q, k_cache, v_cache, table = make_batch(*CASES[case], torch.bfloat16)
    k_values, v_values, scales = stored(k_cache, v_cache, FP8)
    out = flash_attention(q, k_values, v_values, table, **scales)
    exact = flash_attention(q, k_cache, v_cache, table)
    assert torch.nn.functional.cosine_similarity(out.double().flatten(), exact.double().flatten(), dim=0) >= 0.999


@pytest.mark.parametrize("dtype, splits, kv", DTYPE_SPLITS, ids=IDS)
@pytest.mark.parametrize("case", CASES)
def test_key_mass_matches_reference(case, dtype, splits, kv):
    q, k_cache, v_cache, table = make_batch(*CASES[case], dtype)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    mass, mass_ref = (torch.rand(table.num_seqs, table.max_kv, device=DEVICE) for _ in range(2))
    mass_ref.copy_(mass)  # accumulated into, not overwritten
    out = flash_attention(q, k_cache, v_cache, table, key_mass=mass, splits=splits, **scales)
    out_ref = ragged_attention_ref(q, k_cache, v_cache, table, key_mass=mass_ref, **scales)
    assert rel_err(out, out_ref) < BUDGET[dtype]
    assert rel_err(mass, mass_ref) < mass_budget(dtype, kv)


def test_key_mass_when_a_query_tile_has_no_tracked_row():
    """Flash-Cache's decoded rows come first: a tile of them skips the mass sweep and must add nothing."""
    q, k_cache, v_cache, table = make_batch(*CASES["two-query-tiles"], torch.float32)
    rows = torch.arange(q.shape[0], device=DEVICE)
    table.track_rows = (rows >= 66) & (rows < 70)  # request 0's last rows only (its second tile)
    mass, mass_ref = (torch.zeros(table.num_seqs, table.max_kv, device=DEVICE) for _ in range(2))
    flash_attention(q, k_cache, v_cache, table, key_mass=mass)
    ragged_attention_ref(q, k_cache, v_cache, table, key_mass=mass_ref)
    assert rel_err(mass, mass_ref) < 1e-5 and mass[1].abs().sum() == 0

def test_key_mass_is_the_same_every_run():
    """No atomics: a near-tie in the tracked set must not flip from one run to the next."""
    q, k_cache, v_cache, table = make_batch(*CASES["two-query-tiles"], torch.bfloat16)
    masses = [torch.zeros(table.num_seqs, table.max_kv, device=DEVICE) for _ in range(3)]
    for mass in masses:
        flash_attention(q, k_cache, v_cache, table, key_mass=mass)
    assert all(torch.equal(mass, masses[0]) for mass in masses[1:])


@pytest.mark.parametrize("dtype, splits, kv", DTYPE_SPLITS, ids=IDS)
@pytest.mark.parametrize("case", CASES)
def test_verify_pass_matches_reference(case, dtype, splits, kv):
    """The pass's own keys and values in the model's dtype, also beside an fp8 cache."""
    q, k_cache, v_cache, table = make_batch(*CASES[case], dtype, verify=True)
    k_new, v_new = new_keys_and_values(q, k_cache)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    own = dict(k_new=k_new, v_new=v_new, **scales)
    out = flash_attention(q, k_cache, v_cache, table, splits=splits, **own)
    assert rel_err(out, ragged_attention_ref(q, k_cache, v_cache, table, **own)) < BUDGET[dtype]


@pytest.mark.parametrize("dtype, splits, kv", DTYPE_SPLITS, ids=IDS)
def test_verify_with_empty_or_fully_hidden_cache(dtype, splits, kv):
    """Rows that see only the pass's own keys: the running max starts from those scores (no NaN)."""
    q, k_cache, v_cache, table = make_batch([6, 4, 5], [0, 7, 9], 4, 1, 32, dtype, verify=True)
    table.hidden_keys[1] = True  # request 1 hides its whole cache range; request 0 has none
    k_new, v_new = new_keys_and_values(q, k_cache)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    own = dict(k_new=k_new, v_new=v_new, **scales)
    q = q * 30  # large scores: overflow shows up if the max misses the self part
    out = flash_attention(q, k_cache, v_cache, table, splits=splits, **own)
    assert rel_err(out, ragged_attention_ref(q, k_cache, v_cache, table, **own)) < BUDGET[dtype]


@pytest.mark.parametrize("splits", SPLITS)
def test_rows_that_see_no_key_get_zeros(splits):
    """An empty KV range outside the verify pass: 0, not NaN, and no key mass; the other request is unaffected."""
    q, k_cache, v_cache, table = make_batch([3, 2], [0, 6], 2, 2, 16, torch.float32)
    table.track_rows = torch.ones(5, dtype=torch.bool, device=DEVICE)
    mass, mass_ref = (torch.zeros(table.num_seqs, table.max_kv, device=DEVICE) for _ in range(2))
    out = flash_attention(q, k_cache, v_cache, table, key_mass=mass, splits=splits)
    ref = ragged_attention_ref(q, k_cache, v_cache, table, key_mass=mass_ref)
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and mass[0].abs().sum() == 0
    assert rel_err(out[3:], ref[3:]) < 1e-5 and rel_err(mass, mass_ref) < 1e-5


def test_keys_split_only_when_the_programs_do_not_fill_the_gpu_over_a_long_prompt():
    assert num_splits(TARGET_PROGRAMS, 32768, 64) == 1
    assert num_splits(96, 768, 64) == 1              # batch 1, 144 query rows, 32 heads, a short prompt
    assert num_splits(96, 8192, 64) == 3             # the same over 8k keys: 288 programs
    assert num_splits(96, 8192, 64, key_mass=True) == 1 and num_splits(96, 16384, 64, key_mass=True) == 6
    # splits of at most MAX_SPLIT_KEYS keys: batch 1, a block of 32 rows or 144 over a 32k-token prompt
    assert num_splits(32, 32768, 128) == 11 and num_splits(96, 32768, 64, key_mass=True) == 11


def test_no_rows_and_verify_mass_refused():
    q, k_cache, v_cache, table = make_batch([0, 0], [4, 0], 2, 2, 16, torch.float32)
    assert flash_attention(q, k_cache, v_cache, table).shape == (0, 2, 16)
    with pytest.raises(ValueError):
        flash_attention(q, k_cache, v_cache, table, key_mass=torch.zeros(2, 4), k_new=q, v_new=q)


def routed_masks(q, k_cache, table, seed=2):
    """Random routed keys [B, Hkv, max_kv] (about half)."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv = table.kv_start.shape[0], k_cache.shape[1]
    return (torch.rand(B, Hkv, table.max_kv, generator=g) < 0.5).to(DEVICE)


@pytest.mark.parametrize("dtype, splits, kv", DTYPE_SPLITS, ids=IDS)
@pytest.mark.parametrize("case", ["ragged-gqa", "two-query-tiles", "dream-gqa-7"])
def test_routed_keys_match_reference(case, dtype, splits, kv):
    """Each KV head reads only its routed keys; with the key mass, and in the verify pass (whose hidden keys stay
    hidden)."""
    q, k_cache, v_cache, table = make_batch(*CASES[case], dtype)
    visible = routed_masks(q, k_cache, table)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    mass, ref_mass = (torch.zeros(table.kv_start.shape[0], table.max_kv, device=DEVICE) for _ in range(2))
    out = flash_attention(q, k_cache, v_cache, table, mass, splits=splits, routed=routed_keys(visible, table.kv_len),
                          **scales)
    ref = ragged_attention_ref(q, k_cache, v_cache, table, ref_mass, key_visible=visible, **scales)
    assert rel_err(out, ref) < BUDGET[dtype] and rel_err(mass, ref_mass) < BUDGET[dtype]
    q, k_cache, v_cache, table = make_batch(*CASES[case], dtype, verify=True)
    k_new, v_new = new_keys_and_values(q, k_cache)
    visible = routed_masks(q, k_cache, table)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    out = flash_attention(q, k_cache, v_cache, table, k_new=k_new, v_new=v_new, splits=splits,
                          routed=routed_keys(visible, table.kv_len), **scales)
    ref = ragged_attention_ref(q, k_cache, v_cache, table, k_new=k_new, v_new=v_new, key_visible=visible, **scales)
    assert rel_err(out, ref) < BUDGET[dtype]


def chunk_routed_masks(table, kv_heads, dense_request, seed=3):
    """Routed keys open by 32-key chunk (one in ten: whole key tiles closed), every key of one request."""
    g = torch.Generator().manual_seed(seed)
    B, chunks = table.kv_start.shape[0], -(-table.max_kv // 32)
    opened = torch.rand(B, kv_heads, chunks, generator=g) < 0.1
    opened[dense_request] = True
    return opened.repeat_interleave(32, dim=-1)[..., :table.max_kv].to(DEVICE)


@pytest.mark.parametrize("dtype, splits, kv", DTYPE_SPLITS, ids=IDS)
def test_routed_tile_lists_visit_only_open_chunks(dtype, splits, kv):
    """Long ranges of mostly closed chunks: the kernel visits only the listed tiles (all of them for a request that
    reads every key), with the key mass, and matches the reference."""
    q, k_cache, v_cache, table = make_batch([4, 7, 3, 2], [600, 300, 0, 420], 4, 2, 32, dtype)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    visible = chunk_routed_masks(table, 2, dense_request=1)
    routed = routed_keys(visible, table.kv_len)
    tiles, count = routed.tiles, routed.count
    assert ROUTED_BLOCK_N == 64
    padded = torch.nn.functional.pad(visible, (0, 40))  # max_kv 600 -> 10 tiles of 64
    listed = padded.view(4, 2, 10, 64).any(-1) & (torch.arange(10, device=DEVICE) * 64 < table.kv_len[:, None, None])
    assert not listed[[0, 3]].all()
    assert torch.equal(count[[0, 3]], listed[[0, 3]].sum(-1, dtype=torch.int32))
    assert count[1].tolist() == [5, 5] and count[2].tolist() == [0, 0]  # every tile of its 300 keys; no key
    for b, h in [(0, 0), (0, 1), (3, 1)]:
        assert tiles[b, h, :count[b, h]].tolist() == listed[b, h].nonzero().flatten().tolist()
    mass, ref_mass = (torch.zeros(4, table.max_kv, device=DEVICE) for _ in range(2))
    out = flash_attention(q, k_cache, v_cache, table, mass, splits=splits, routed=routed, **scales)
    ref = ragged_attention_ref(q, k_cache, v_cache, table, ref_mass, key_visible=visible, **scales)
    assert rel_err(out, ref) < BUDGET[dtype] and rel_err(mass, ref_mass) < BUDGET[dtype]


# GQA's two launches (pack_gqa): 2 and 4 query heads per KV head, in few rows (a split launch's merge is a program
# per row and head); in the verify pass, group 4's 17 rows are 68 (row, head) pairs: two packed tiles of 64. Both
# dtypes, the fp8 cache and splits, in 3 of DTYPE_SPLITS' 5 (the interpreter is slow).
GQA_CASES = {"group-2": ([5, 0, 9], [30, 12, 150], 4, 2, 16), "group-4": ([17, 3], [150, 70], 8, 2, 16)}
GQA_DTYPE_SPLITS = [DTYPE_SPLITS[0], DTYPE_SPLITS[3], DTYPE_SPLITS[4]]


@pytest.mark.parametrize("pack_gqa", [True, False], ids=["packed", "per-head"])
@pytest.mark.parametrize("dtype, splits, kv", GQA_DTYPE_SPLITS, ids=[IDS[0], IDS[3], IDS[4]])
@pytest.mark.parametrize("case", GQA_CASES)
def test_gqa_packed_and_per_head_match_reference(case, dtype, splits, kv, pack_gqa):
    """One program per KV head for the rows of all its query heads, or one per query head: the same attention,
    key mass over the tracked rows, routed key tiles per KV head, and the verify pass's own keys under each row's
    visibility."""
    q, k_cache, v_cache, table = make_batch(*GQA_CASES[case], dtype)
    visible = routed_masks(q, k_cache, table)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    for routed, key_visible in [(None, None), (routed_keys(visible, table.kv_len), visible)]:
        mass, mass_ref = (torch.rand(table.num_seqs, table.max_kv, device=DEVICE) for _ in range(2))
        mass_ref.copy_(mass)
        out = flash_attention(q, k_cache, v_cache, table, mass, routed=routed, splits=splits, pack_gqa=pack_gqa,
                              **scales)
        ref = ragged_attention_ref(q, k_cache, v_cache, table, mass_ref, key_visible=key_visible, **scales)
        assert rel_err(out, ref) < BUDGET[dtype] and rel_err(mass, mass_ref) < mass_budget(dtype, kv)
    q, k_cache, v_cache, table = make_batch(*GQA_CASES[case], dtype, verify=True)
    k_new, v_new = new_keys_and_values(q, k_cache)
    visible = routed_masks(q, k_cache, table)
    k_cache, v_cache, scales = stored(k_cache, v_cache, kv)
    own = dict(k_new=k_new, v_new=v_new, **scales)
    out = flash_attention(q, k_cache, v_cache, table, routed=routed_keys(visible, table.kv_len), splits=splits,
                          pack_gqa=pack_gqa, **own)
    assert rel_err(out, ragged_attention_ref(q, k_cache, v_cache, table, key_visible=visible, **own)) < BUDGET[dtype]


def test_packed_tiles_hold_the_rows_of_every_query_head_of_a_kv_head():
    """A decoding block of 32 rows with 4 query heads per KV head (LLaDA2-mini): one tile of 128 (row, head)
    pairs, not 4 of 32 rows."""
    assert launch_config(32)["BLOCK_M"] == 32 and launch_config(32, pack=4)["BLOCK_M"] == 128
    assert launch_config(8, pack=4)["BLOCK_M"] == 32 and launch_config(16, pack=4)["BLOCK_M"] == 64
