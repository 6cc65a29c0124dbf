"""The cached forward: flat query rows, K/V written to the flat cache, ragged attention over each
request's range, against the padded full forward."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flash_dllm import load_model
from flash_dllm.cache import CacheAllocator, KVCache
from flash_dllm.cache.attention_metadata import AttentionMetadata
from flash_dllm.decoding.elastic import layer_keys
from flash_dllm.kernels.fp8 import quantize_rows_ref
from flash_dllm.kernels.kv_fp8 import dequantize_kv


def rel_err(a, b):
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def table_for(lengths, starts, bases, counts, track=None):
    counts_t = torch.tensor(counts)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), counts_t.cumsum(0)])
    slots = torch.cat([torch.arange(b + s, b + s + n) for b, s, n in zip(bases, starts, counts)])
    return AttentionMetadata(cu_seqlens_q=cu, kv_start=torch.tensor(bases), kv_len=torch.tensor(lengths),
                      slot_mapping=slots, max_q=max(counts), max_kv=max(lengths), track_rows=track)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


def test_full_and_partial_queries_match_padded_forward(model):
    """Prefill every position of two requests of different lengths, then recompute only a window of
    each with the rest served from the cache: both equal the full forward of each request alone."""
    cfg = model.config
    lengths, bases = [23, 9], [40, 3]  # ranges anywhere in the cache, in any order
    seqs = [torch.randint(4, cfg.vocab_size, (n,)) for n in lengths]
    expected = [model.hidden_states(s[None])[0] for s in seqs]
    cache = KVCache(cfg, 80, torch.float32, "cpu")

    ids, positions = torch.cat(seqs), torch.cat([torch.arange(n) for n in lengths])
    hidden = model.forward_cached(ids, positions, table_for(lengths, [0, 0], bases, lengths), cache)
    assert rel_err(hidden, torch.cat(expected)) < 1e-5

    starts, counts = [5, 2], [7, 4]
    ids = torch.cat([s[a:a + n] for s, a, n in zip(seqs, starts, counts)])
    positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, counts)])
    hidden = model.forward_cached(ids, positions, table_for(lengths, starts, bases, counts), cache)
    assert rel_err(hidden, torch.cat([e[a:a + n] for e, a, n in zip(expected, starts, counts)])) < 1e-5


def test_key_mass_is_softmax_mass_of_tracked_rows(model):
    cfg = model.config
    length = 12
    ids = torch.randint(4, cfg.vocab_size, (length,))
    cache = KVCache(cfg, length, torch.float32, "cpu")
    track = torch.zeros(length, dtype=torch.bool)
    track[[3, 7]] = True
    mass = torch.zeros(1, length)
    table = table_for([length], [0], [0], [length], track)
    hidden = model.forward_cached(ids, torch.arange(length), table, cache, key_mass=mass)
    assert rel_err(hidden, model.hidden_states(ids[None])[0]) < 1e-5
    # each tracked row's probabilities sum to one, per head and layer
    assert torch.allclose(mass.sum(), torch.tensor(2.0 * cfg.num_heads * cfg.num_layers))


def test_allocator_first_fit_and_merge():
    allocator = CacheAllocator(100, align=1)
    a, b, c = allocator.allocate(30), allocator.allocate(30), allocator.allocate(30)
    assert (a, b, c) == (0, 30, 60) and allocator.allocate(20) is None
    allocator.release(b, 30)
    assert allocator.allocate(20) == 30
    allocator.release(a, 30)
    allocator.release(30, 20)
    allocator.release(c, 30)
    assert allocator.num_free == 100 and len(allocator.free) == 1


def test_allocator_aligns_ranges_and_fills_the_cache_tail():
    allocator = CacheAllocator(100, align=32)
    a, b = allocator.allocate(30), allocator.allocate(1)
    assert (a, b) == (0, 32) and allocator.allocate(37) is None
    assert allocator.allocate(33) == 64 and allocator.num_free == 0  # the cache's last 36 rows, not 64
    allocator.release(64, 33)
    assert allocator.allocate(3) == 64 and allocator.allocate(3) == 96  # the tail's last 4 rows
    allocator.release(a, 30)
    allocator.release(b, 1)
    allocator.release(64, 3)
    allocator.release(96, 3)
    assert allocator.num_free == 100 and len(allocator.free) == 1
    with pytest.raises(ValueError, match="can never fit in a KV cache of 100 tokens"):
        allocator.allocate(101)


def test_cache_budget(model):
    per_row = KVCache.bytes_per_row(model.config, torch.bfloat16)
    assert per_row == model.config.kv_bytes_per_token
    assert KVCache.from_budget(model.config, 10 * per_row + 5, torch.bfloat16, "cpu").num_rows == 10
    with pytest.raises(ValueError, match="holds no token"):
        KVCache.from_budget(model.config, per_row - 1, torch.bfloat16, "cpu")


def test_fp8_cache_budget_holds_about_twice_the_rows(model):
    """E4M3 K and V and an fp32 scale per row and KV head: at LLaDA-8B's head_dim (128) 132 bytes a head where bf16
    takes 256. The hidden states, chunk summaries and k-means regions stay in the model's dtype."""
    cfg, fp8 = model.config, torch.float8_e4m3fn
    llada_8b = SimpleNamespace(num_layers=32, num_kv_heads=32, head_dim=128, hidden_size=4096)
    assert KVCache.bytes_per_row(llada_8b, torch.bfloat16, kv_dtype=fp8) * 256 == \
        KVCache.bytes_per_row(llada_8b, torch.bfloat16) * 132
    per_row = KVCache.bytes_per_row(cfg, torch.bfloat16, kv_dtype=fp8)
    assert per_row == cfg.kv_bytes_per_token // 2 + 2 * cfg.num_layers * cfg.num_kv_heads * 4
    assert KVCache.bytes_per_row(cfg, torch.bfloat16, with_hidden=True, kv_dtype=fp8) == \
        per_row + cfg.num_layers * cfg.hidden_size * 2
    budget = 10 * KVCache.bytes_per_row(cfg, torch.bfloat16)
    cache = KVCache.from_budget(cfg, budget, torch.bfloat16, "cpu", kv_dtype=fp8)
    assert cache.num_rows == budget // per_row > 10
    assert cache.k[0].dtype == cache.v[0].dtype == fp8 and cache.dtype == torch.bfloat16
    assert cache.k_scale[0].shape == cache.v_scale[0].shape == (cache.num_rows + 1, cfg.num_kv_heads)
    assert cache.nbytes == (cache.num_rows + 1) * per_row
    assert cache.scales(1) == dict(k_scale=cache.k_scale[1], v_scale=cache.v_scale[1])
    assert cache.chunk_summaries(32)[0].dtype == cache.hidden_states()[0].dtype == torch.bfloat16
    assert KVCache(cfg, 4, torch.bfloat16, "cpu").scales(0) == {}
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        KVCache(cfg, 4, torch.bfloat16, "cpu", kv_dtype=torch.float16)


def test_an_fp8_cache_stores_each_head_quantised(model):
    """KVCache.write (the PyTorch path's) stores quantize_rows_ref's values and scales; Elastic-Cache reads the keys
    back dequantised, in the model's dtype."""
    cfg = model.config
    cache = KVCache(cfg, 8, torch.float32, "cpu", kv_dtype=torch.float8_e4m3fn)
    k, v = (torch.randn(3, cfg.num_kv_heads, cfg.head_dim, generator=torch.Generator().manual_seed(i)) for i in (0, 1))
    slots = torch.tensor([5, 0, 2])
    cache.write(1, slots, k, v)
    for values, scale, rows in ((cache.k[1], cache.k_scale[1], k), (cache.v[1], cache.v_scale[1], v)):
        expected, expected_scale = quantize_rows_ref(rows)
        assert torch.equal(values[slots].view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(scale[slots], expected_scale) and not values[[1, 3, 4]].float().any()
    keys = layer_keys(cache, 1, slots)
    assert keys.dtype == torch.float32 and torch.equal(keys, dequantize_kv(*quantize_rows_ref(k), torch.float32))


def test_allocator_compacts_the_held_ranges_into_one_free_range():
    """Free rows split into holes that no request fits: compaction slides the held ranges (adjacent ones as one) to
    the start and returns the moves; the moved requests release as before."""
    allocator = CacheAllocator(100, align=1)
    a, b, c = allocator.allocate(30), allocator.allocate(30), allocator.allocate(30)
    allocator.release(b, 30)
    assert allocator.allocate(35) is None and allocator.fits_compacted(35) and not allocator.fits_compacted(41)
    assert allocator.compact() == [(60, 30, 30)] and allocator.allocate(35) == 60
    allocator.release(a, 30)
    allocator.release(30, 30)  # c, moved
    allocator.release(60, 35)
    assert allocator.num_free == 100 and len(allocator.free) == 1
    # aligned: a range that ends the cache holds fewer rows than its rounded length until it moves
    allocator = CacheAllocator(100, align=32)
    a, b, c = allocator.allocate(30), allocator.allocate(33), allocator.allocate(3)
    assert (a, b, c) == (0, 32, 96) and allocator.num_free == 0
    allocator.release(a, 30)
    assert allocator.fits_compacted(4) and not allocator.fits_compacted(5)  # c holds 32 rows once moved
    assert allocator.compact() == [(32, 0, 68)] and allocator.free[0].start == 96
    allocator.release(0, 33)
    allocator.release(64, 3)
    assert allocator.num_free == 100 and len(allocator.free) == 1
    assert CacheAllocator(64).compact() == []


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_cache_rows_move_with_everything_kept_beside_them(model, kv_dtype):
    """K, V, their fp8 scales, the hidden states, each row's k-means region and each chunk's summaries and regions
    follow a move, also one that overlaps its own new place; rows outside it stay."""
    cache = KVCache(model.config, 160, torch.float32, "cpu", kv_dtype=kv_dtype)
    cache.hidden_states(), cache.chunk_summaries(32), cache.kmeans_regions(32)
    tensors = [*cache.k, *cache.v, *(cache.k_scale or []), *(cache.v_scale or []), *cache.hidden_states(),
               *cache.kmeans_regions(32)[1], *cache.kmeans_regions(32)[3]]
    chunked = [*cache.chunk_summaries(32), *cache.kmeans_regions(32)[0], *cache.kmeans_regions(32)[2]]
    generator = torch.Generator().manual_seed(0)
    for t in (*tensors, *chunked):
        t.copy_(torch.randint(-100, 100, t.shape, generator=generator).to(t.dtype))
    before = [t.clone() for t in (*tensors, *chunked)]
    cache.move_rows([(64, 0, 40), (128, 64, 32)])  # the first over rows it does not hold; then one onto rows it left
    for t, old in zip(tensors, before):
        assert torch.equal(t[:40].float(), old[64:104].float()) and torch.equal(t[64:96].float(), old[128:160].float())
        assert torch.equal(t[96:].float(), old[96:].float())  # not a target: as it was
    for t, old in zip(chunked, before[len(tensors):]):
        assert torch.equal(t[:2].float(), old[2:4].float()) and torch.equal(t[2].float(), old[4].float())
    keys = cache.k[0].clone()
    cache.move_rows([(32, 0, 96)])  # overlapping its own new place
    assert torch.equal(cache.k[0][:96].float(), keys[32:128].float())


def test_a_compaction_whose_move_fails_changes_nothing():
    allocator = CacheAllocator(100, align=1)
    a, b = allocator.allocate(30), allocator.allocate(30)
    allocator.release(a, 30)

    def failing(moves):
        assert moves == [(30, 0, 30)]
        raise MemoryError

    with pytest.raises(MemoryError):
        allocator.compact(failing)
    assert [(r.start, r.length) for r in allocator.free] == [(0, 30), (60, 40)]
