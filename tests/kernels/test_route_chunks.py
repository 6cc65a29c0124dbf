"""The routing kernels (kernels/route_chunks.py) against their reference: the same keys hidden, tile lists and
keys counted, for every policy, requests dense, not pure (prompt rows in the pass) or at different cache
offsets, budgets from nothing to everything, equal scores (opened in chunk order, k-means regions in region
order) and k-means regions of any size."""
from kernel_testing import DEVICE  # first: it picks the interpreter on the CPU

import pytest
import torch

from flash_dllm.cache.attention_metadata import AttentionMetadata
from flash_dllm.cache.routing import CHUNK, SINKS, WINDOW, PromptRouting
from flash_dllm.kernels.route_chunks import route_chunks, route_chunks_ref

HKV, GROUP, D = 2, 2, 32
PROMPTS = [300, 260, 500, 200, 330]
KV_START = [0, 384, 704, 1216, 1472]   # multiples of CHUNK, the ranges apart
CACHE_ROWS = 2048


def routed_pass(policies, budget, rows=8, not_pure=(), dtype=torch.float32, summaries=None, seed=0,
                prompts=PROMPTS, kv_starts=KV_START, cache_rows=CACHE_ROWS, kmeans=None):
    """`rows` query rows per request past its prompt (a request in `not_pure` has one in its prompt), random
    queries and chunk summaries (and `kmeans`: k-means regions, `kmeans_state`); the reference's and the
    kernels' RoutedKeys and keys counted."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompts)
    lengths = [p + 40 for p in prompts]
    positions = torch.cat([torch.arange(p - (b in not_pure), p - (b in not_pure) + rows)
                           for b, p in enumerate(prompts)])
    row_request = torch.arange(B).repeat_interleave(rows)
    q = torch.randn(B * rows, HKV * GROUP, D, generator=g).to(dtype).to(DEVICE)
    if summaries is None:
        upper = torch.randn(cache_rows // CHUNK, HKV, D, generator=g)
        lower = upper - torch.rand(cache_rows // CHUNK, HKV, D, generator=g)
        summaries = torch.stack([lower, upper, (lower + upper) / 2], dim=1)
    summaries = summaries.to(dtype).to(DEVICE)
    results = []
    for route in (route_chunks_ref, route_chunks):
        counters = (torch.zeros(B, dtype=torch.long, device=DEVICE), torch.zeros(B, dtype=torch.long, device=DEVICE))
        routing = PromptRouting.build(prompts, lengths, [rows] * B, True, [budget] * B, policies,
                                      row_request.to(DEVICE), positions.to(DEVICE), torch.arange(B, device=DEVICE),
                                      *counters, lambda values: torch.tensor(values, device=DEVICE))
        kv_start = torch.tensor(kv_starts, device=DEVICE)
        metadata = AttentionMetadata(cu_seqlens_q=torch.arange(B + 1, device=DEVICE) * rows, kv_start=kv_start,
                                     kv_len=torch.tensor(lengths, device=DEVICE),
                                     slot_mapping=kv_start[row_request.to(DEVICE)] + positions.to(DEVICE),
                                     max_q=rows, max_kv=max(lengths), routing=routing)
        state = kmeans and (kmeans[0].to(dtype).to(DEVICE), *(part.to(DEVICE) for part in kmeans[1:]))
        results.append((route(q, summaries, metadata, layer=3, kmeans=state), counters))
    return results


def assert_same(reference, kernel):
    (ref, ref_counts), (out, counts) = reference, kernel
    assert torch.equal(out.hidden, ref.hidden)
    assert torch.equal(out.count, ref.count)
    for b in range(ref.count.shape[0]):
        for h in range(HKV):
            assert torch.equal(out.tiles[b, h, :ref.count[b, h]], ref.tiles[b, h, :ref.count[b, h]])
    assert all(torch.equal(a, b) for a, b in zip(counts, ref_counts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_policy_dense_and_not_pure_requests(dtype):
    policies = ["chunk", "centroid", "window", "random", "chunk"]
    reference, kernel = routed_pass(policies, budget=0.3, not_pure=(4,), dtype=dtype)
    assert_same(reference, kernel)
    hidden = kernel[0].hidden
    assert hidden[:4, :, :PROMPTS[0] - 40].any() and not hidden[4, :, :PROMPTS[4]].any()  # 4 reads in full
    reference, kernel = routed_pass(["chunk", None, "random", "centroid", "window"], budget=0.5, dtype=dtype)
    assert_same(reference, kernel)
    assert not kernel[0].hidden[1, :, :PROMPTS[1]].any()  # a dense request


@pytest.mark.parametrize("budget", [0.01, 1.0])
def test_budgets_of_nothing_and_everything(budget):
    reference, kernel = routed_pass(["chunk", "centroid", "window", "random", "chunk"], budget=budget)
    assert_same(reference, kernel)
    read, dense = kernel[1]
    assert (read == dense).all() if budget == 1.0 else (read < dense).all()


def test_equal_scores_open_in_chunk_order():
    """Summaries of zeros score every chunk 0 (some as -0.0): the first chunks of the budget open."""
    summaries = torch.zeros(CACHE_ROWS // CHUNK, 3, HKV, D)
    reference, kernel = routed_pass(["chunk"] * 5, budget=0.3, summaries=summaries)
    assert_same(reference, kernel)
    opened = ~kernel[0].hidden[0, 0, :PROMPTS[0]]
    assert opened[:CHUNK].all() and not opened[CHUNK:2 * CHUNK].any()  # one chunk of the budget: the first


@pytest.mark.parametrize("zeros", [False, True])
def test_long_prompts_span_several_blocks_of_chunks(zeros):
    """Prompts of 4,500 and 2,300 keys: the picking program's blocks of chunks carry the count of equal scores
    seen and of tiles listed from one block to the next (summaries of zeros: every score equal)."""
    long = dict(prompts=[4500, 2300], kv_starts=[0, 4608], cache_rows=8192)
    summaries = torch.zeros(8192 // CHUNK, 3, HKV, D) if zeros else None
    for policies in (["chunk", "chunk"], ["window", "random"], ["centroid", None]):
        reference, kernel = routed_pass(policies, budget=0.3, summaries=summaries, **long)
        assert_same(reference, kernel)
    if zeros:  # the first chunks of the budget, across blocks
        opened = ~kernel[0].hidden[0, 0, :4500 - 32]
        assert opened[:CHUNK * 30].all() and not opened[CHUNK * 50:].any()


def kmeans_state(prompts=PROMPTS, kv_starts=KV_START, cache_rows=CACHE_ROWS, zeros=False, seed=1):
    """KVCache.kmeans_regions' layer entries as a rebuild leaves them: per request and KV head, its routable run
    (positions SINKS to prompt - WINDOW) cut into regions of 1 to 80 keys (the last: the rest), held region after
    region, some region indices left empty; random bounds (`zeros`: all zero, every score equal)."""
    g = torch.Generator().manual_seed(seed)
    upper = torch.zeros(cache_rows // CHUNK + 1, HKV, D) if zeros else torch.randn(cache_rows // CHUNK + 1, HKV, D,
                                                                                   generator=g)
    lower = upper - (0 if zeros else torch.rand(upper.shape, generator=g))
    summaries = torch.stack([lower, upper, (lower + upper) / 2], dim=1)
    key_region = torch.full((cache_rows + 1, HKV), -1, dtype=torch.int32)
    region_size = torch.zeros(cache_rows // CHUNK + 1, HKV, dtype=torch.int32)
    for prompt, start in zip(prompts, kv_starts):
        for h in range(HKV):
            position, region, end = SINKS, 0, prompt - WINDOW
            regions = -(-(end - SINKS) // CHUNK)  # as many as k-means makes: the last takes what is left
            while position < end:
                region += int(torch.randint(0, 4, (), generator=g) == 0 and region < regions - 1)  # one left empty
                size = end - position if region == regions - 1 else min(int(torch.randint(1, 81, (), generator=g)),
                                                                            end - position)
                key_region[start + position:start + position + size, h] = region
                region_size[start // CHUNK + region, h] = size
                position, region = position + size, region + 1
    return summaries, key_region, region_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kmeans_regions_open_within_the_budget_of_keys(dtype):
    kmeans = kmeans_state()
    for policies, budget in ((["kmeans"] * 5, 0.3), (["kmeans", "chunk", None, "random", "kmeans"], 0.5),
                             (["kmeans"] * 5, 0.01), (["kmeans"] * 5, 0.9)):
        reference, kernel = routed_pass(policies, budget=budget, not_pure=(4,), dtype=dtype, kmeans=kmeans)
        assert_same(reference, kernel)
    hidden = kernel[0].hidden
    assert hidden[0, :, :PROMPTS[0] - WINDOW].any() and not hidden[4, :, :PROMPTS[4]].any()  # 4 reads in full


def test_kmeans_equal_scores_open_in_region_order_across_blocks():
    long = dict(prompts=[4500, 2300], kv_starts=[0, 4608], cache_rows=8192)
    kmeans = kmeans_state(zeros=True, **long)
    reference, kernel = routed_pass(["kmeans", "kmeans"], budget=0.3, kmeans=kmeans, **long)
    assert_same(reference, kernel)
    opened = ~kernel[0].hidden[0, 0, :4500 - WINDOW]
    assert opened[:CHUNK * 30].all() and not opened[CHUNK * 50:].any()  # the first regions, by position
