"""Routing of the prompt's KV (cache/routing.py): which keys a step reads under each policy, the budget, the
rows that read every key and the keys-read count; through the engine, a budget of 1 is the dense attention token
for token, the kernel path routes as the reference does, and the settings are checked."""
from __future__ import annotations

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from types import SimpleNamespace

from flash_dllm.cache.regions import kmeans_assignment, region_summaries
from flash_dllm.cache.routing import (CHUNK, POLICIES, SINKS, WINDOW, PromptRouting, chunks_opened, route,
                                      summarise, update_kmeans, visible_keys)
from flash_dllm.kernels.fp8 import quantize_rows_ref
from flash_dllm.kernels.kv_fp8 import dequantize_kv

B, K, HKV, GROUP, D = 3, 300, 2, 2, 8
PROMPT = [260, 260, 200]


def routing_of(policies, budget=0.125, positions=None, counts=None, clustered=None):
    """A pass of 4 query rows per request at positions past its prompt (unless `positions` and the rows per
    request `counts` say otherwise)."""
    counts = counts or [4] * B
    rows = torch.arange(B).repeat_interleave(torch.tensor(counts))
    positions = torch.tensor(PROMPT).repeat_interleave(4) if positions is None else positions
    counters = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    return PromptRouting.build(PROMPT, [p + 40 for p in PROMPT], counts, True, [budget] * B, policies, rows,
                               positions, torch.arange(B), *counters, lambda values: torch.tensor(values),
                               clustered=clustered)


def step(policies, budget=0.125, needle=None, positions=None):
    """Random keys of B requests (their prompts, then 40 generated keys), a needle chunk whose keys all align
    with the queries (request, chunk), and the keys each KV head reads."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(B, K, HKV, D, generator=g)
    q = torch.randn(B * 4, HKV * GROUP, D, generator=g).abs()
    if needle is not None:
        b, chunk = needle
        keys[b, chunk * CHUNK:(chunk + 1) * CHUNK] = 3.0  # every query (positive) scores these keys highest
    kv_len = torch.tensor([p + 40 for p in PROMPT])
    key_valid = torch.arange(K) < kv_len[:, None]
    routing = routing_of(policies, budget, positions)
    metadata = SimpleNamespace(cu_seqlens_q=torch.arange(B + 1) * 4, max_q=4, max_kv=K, kv_len=kv_len,
                               kv_start=torch.zeros(B, dtype=torch.long), write_cache=True, routing=routing)
    summaries = summarise(keys, routing.keys_of_pass(metadata, HKV).in_prompt)
    return visible_keys(q, summaries, metadata, layer=0), key_valid, routing


def test_the_budget_counts_sinks_and_window_in_whole_chunks():
    assert chunks_opened(1000, 0.125) == (125 - SINKS - WINDOW) // CHUNK
    assert chunks_opened(100, 0.125) == 0  # the sinks and the window take the whole budget
    assert chunks_opened(1000, 1.0) == -(-1000 // CHUNK)  # every chunk: the dense attention


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "kmeans"])
def test_each_head_reads_sinks_window_generated_keys_and_its_top_chunks(policy):
    visible, key_valid, routing = step([policy] * B, budget=0.5)
    position = torch.arange(K)
    for b, prompt in enumerate(PROMPT):
        top_k = chunks_opened(prompt, 0.5)
        assert top_k == 2
        always = (position < SINKS) | ((position >= prompt - WINDOW) & key_valid[b])
        assert visible[b][:, always].all() and not visible[b][:, ~key_valid[b]].any()
        routed = visible[b][:, (position >= SINKS) & (position < prompt - WINDOW)]
        chunks = {h: set((torch.nonzero(routed[h]).flatten() + SINKS).div(CHUNK, rounding_mode="floor").tolist())
                  for h in range(HKV)}
        assert all(len(c) == top_k for c in chunks.values())
        if policy == "window":  # the chunks right before the window
            last = (prompt - WINDOW - 1) // CHUNK
            assert all(c == set(range(last - top_k + 1, last + 1)) for c in chunks.values())
    assert torch.equal(routing.keys_dense, torch.tensor(PROMPT) * HKV)
    assert torch.equal(routing.keys_read, (visible & (position < torch.tensor(PROMPT)[:, None, None])).sum((1, 2)))


def test_chunk_scores_find_the_needle_and_the_controls_do_not():
    needle = (1, 3)
    opened = lambda policy: step([policy] * B, budget=0.5, needle=needle)[0][1][:, 3 * CHUNK:4 * CHUNK].all(dim=-1)
    assert opened("chunk").all() and opened("centroid").all()
    assert not opened("window").any()


SPAN = 320  # each request's cache range in the k-means passes (a multiple of CHUNK)


def kmeans_pass(cache, policies, budget, counts=None, positions=None, q=None, clustered=None):
    """One pass over the flat cache (`kmeans_cache`; requests at multiples of SPAN, the last row a scratch): 4 rows
    per request past its prompt, or `counts` rows at `positions` (a full pass: every position); it writes nothing
    new, updates the k-means regions and their layout and returns the keys read [B, HKV, K]."""
    routing = routing_of(policies, budget, positions, counts, clustered)
    counts = counts or [4] * B
    starts = torch.arange(B) * SPAN
    kv_len = torch.tensor([p + 40 for p in PROMPT])
    positions = routing.row_request * 0 + torch.tensor(PROMPT)[routing.row_request] if positions is None else positions
    metadata = SimpleNamespace(cu_seqlens_q=torch.tensor([0, *counts]).cumsum(0), max_q=max(counts), max_kv=K,
                               kv_len=kv_len, kv_start=starts, write_cache=True, routing=routing,
                               slot_mapping=starts[routing.row_request] + positions)
    update_kmeans(cache.k, cache.v, *cache.state, metadata, **cache.scales)
    if q is None:
        q = torch.randn(sum(counts), HKV * GROUP, D, generator=torch.Generator().manual_seed(1))
    visible = None if routing.read_in_full else route(q, cache.k, metadata, 0, kmeans=cache.state,
                                                      k_scale=cache.scales.get("k_scale"))
    return visible, routing


def kmeans_cache(fp8: bool = False):
    """Random keys and values in the flat layout, and an empty k-means state beside them (KVCache.kmeans_regions':
    the region summaries with one scratch entry, each row's region, each region's size); fp8: K and V in E4M3 and
    their scales (`scales`, as keyword arguments)."""
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(B * SPAN + 1, HKV, D, generator=g) for _ in range(2))
    scales = {}
    if fp8:
        (k, k_scale), (v, v_scale) = quantize_rows_ref(k), quantize_rows_ref(v)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    summaries = torch.zeros(B * SPAN // CHUNK + 1, 3, HKV, D)
    return SimpleNamespace(k=k, v=v, scales=scales,
                           state=(summaries, torch.full((B * SPAN + 1, HKV), -1, dtype=torch.int32),
                                  torch.zeros(B * SPAN // CHUNK + 1, HKV, dtype=torch.int32),
                                  torch.full((B * SPAN + 1, HKV), -1, dtype=torch.int32)))


def full_pass(cache, clustered=None):
    lengths = [p + 40 for p in PROMPT]
    positions = torch.cat([torch.arange(n) for n in lengths])
    return kmeans_pass(cache, ["kmeans"] * B, 0.25, counts=lengths, positions=positions, clustered=clustered)


def test_kmeans_regions_are_built_by_a_full_pass_and_laid_out_region_after_region():
    cache = kmeans_cache()
    summaries, key_region, region_size, assignment = cache.state
    before_k, before_v = cache.k.clone(), cache.v.clone()
    _, routing = full_pass(cache)
    assert routing.any_rebuild and routing.read_in_full
    position = torch.arange(K)
    for b, prompt in enumerate(PROMPT):
        rows = slice(b * SPAN, b * SPAN + K)
        keys = before_k[rows].transpose(0, 1)                                               # [HKV, K, D]
        routable = (position >= SINKS) & (position < prompt - WINDOW)
        assign = kmeans_assignment(keys, CHUNK, routable.expand(HKV, K))
        centroids, lower, upper, sizes = region_summaries(keys, assign, -(-K // CHUNK))
        stored = summaries[b * SPAN // CHUNK:(b + 1) * SPAN // CHUNK][:len(sizes[0])]       # [C, 3, HKV, D]
        filled = sizes.T > 0
        torch.testing.assert_close(stored[:, 0][filled], lower.transpose(0, 1)[filled])
        torch.testing.assert_close(stored[:, 2][filled], centroids.transpose(0, 1)[filled])
        assert sizes.sum(dim=1).tolist() == [prompt - SINKS - WINDOW] * HKV
        in_range = -(-(prompt + 40) // CHUNK)  # the request's chunks: its regions' entries
        assert torch.equal(region_size[b * SPAN // CHUNK:][:in_range].T.long(), sizes[:, :in_range])
        assert not sizes[:, in_range:].any()
        for h in range(HKV):
            # the routable run holds the same (K, V) pairs, region after region, by position within a region
            order = SINKS + assign[h, routable].sort(stable=True).indices
            run = rows.start + position[routable]
            assert torch.equal(cache.k[run, h], before_k[rows.start + order, h])
            assert torch.equal(cache.v[run, h], before_v[rows.start + order, h])
            assert torch.equal(key_region[run, h].long(), assign[h, order])
            assert torch.equal(assignment[rows, h].long(), assign[h])  # by position: a later full pass keeps it
            # the sinks, the window and the generated part stay where they are, as does every other request's row
            kept = rows.start + position[~routable]
            assert torch.equal(cache.k[kept, h], before_k[kept, h]) and torch.equal(cache.v[kept, h], before_v[kept, h])
            assert (key_region[kept[kept < rows.start + prompt + 40], h] == -1).all()


def test_a_later_full_pass_keeps_the_grouping_and_summarises_the_new_keys():
    """Dual-Cache's block pass (or an Elastic refresh) rewrites the prompt's keys in position order: with regions
    already built, k-means does not run again; each position keeps its region, the new keys are laid out by it
    and the summaries are theirs."""
    cache = kmeans_cache()
    full_pass(cache)
    summaries, key_region, region_size, assignment = cache.state
    kept, sizes = assignment.clone(), region_size.clone()
    g = torch.Generator().manual_seed(5)
    fresh_k, fresh_v = torch.randn(cache.k.shape, generator=g), torch.randn(cache.v.shape, generator=g)
    cache.k.copy_(fresh_k)  # the full pass's new keys and values, in position order
    cache.v.copy_(fresh_v)
    _, routing = full_pass(cache, clustered=[True, False, True])
    assert routing.recluster_lengths == (0, PROMPT[1] + 40, 0)
    position = torch.arange(K)
    for b in (0, 2):
        rows = slice(b * SPAN, b * SPAN + K)
        assert torch.equal(assignment[rows], kept[rows])
        assert torch.equal(region_size[b * SPAN // CHUNK:(b + 1) * SPAN // CHUNK],
                           sizes[b * SPAN // CHUNK:(b + 1) * SPAN // CHUNK])
        routable = (position >= SINKS) & (position < PROMPT[b] - WINDOW)
        for h in range(HKV):
            order = SINKS + kept[rows, h][routable].long().sort(stable=True).indices
            run = rows.start + position[routable]
            assert torch.equal(cache.k[run, h], fresh_k[rows.start + order, h])
            assert torch.equal(cache.v[run, h], fresh_v[rows.start + order, h])
            first = int(kept[rows.start + SINKS, h])  # its region's upper bound, of the new keys
            members = fresh_k[rows.start + position[kept[rows, h] == first], h]
            torch.testing.assert_close(summaries[b * SPAN // CHUNK + first, 1, h], members.amax(dim=0))


def test_an_fp8_cache_is_routed_as_its_dequantised_keys():
    """update_kmeans groups an fp8 cache's keys dequantised and moves each scale with its row; route summarises them
    dequantised: the regions, layout and keys read of a cache holding those keys in fp32."""
    fp8, dequantized = kmeans_cache(fp8=True), kmeans_cache()
    as_fp32 = lambda cache: [dequantize_kv(cache.k, cache.scales["k_scale"], torch.float32),
                             dequantize_kv(cache.v, cache.scales["v_scale"], torch.float32)]
    dequantized.k, dequantized.v = as_fp32(fp8)
    visible = []
    for cache in (fp8, dequantized):
        full_pass(cache)
        visible.append(kmeans_pass(cache, ["kmeans", "chunk", "centroid"], 0.5)[0])
    assert torch.equal(*visible)
    for values, expected in zip(as_fp32(fp8), (dequantized.k, dequantized.v)):  # each value beside its scale
        assert torch.equal(values, expected)
    for part, dequantized_part in zip(fp8.state, dequantized.state):
        assert torch.equal(part, dequantized_part)


def test_kmeans_opens_the_best_regions_within_the_budget_as_contiguous_runs():
    cache = kmeans_cache()
    cache.k[SPAN + 100:SPAN + 164:2] = 3.0  # a needle of 32 keys, not contiguous: one region holds them
    full_pass(cache)
    key_region = cache.state[1]
    q = torch.randn(4 * B, HKV * GROUP, D, generator=torch.Generator().manual_seed(1)).abs()
    visible, routing = kmeans_pass(cache, ["kmeans"] * B, 0.5, q=q)
    position = torch.arange(K)
    for h in range(HKV):  # the needle's region, now one range of rows, is opened for every head
        needle = (cache.k[SPAN:SPAN + K, h] == 3.0).all(dim=-1)
        region = key_region[SPAN:SPAN + K, h][needle].unique()
        held = position[key_region[SPAN:SPAN + K, h] == region]
        assert len(region) == 1 and held[-1] - held[0] == len(held) - 1 and visible[1][h, held].all()
    for b, prompt in enumerate(PROMPT):
        run = (position >= SINKS) & (position < prompt - WINDOW)
        routed = visible[b][:, run]
        budget = chunks_opened(prompt, 0.5) * CHUNK
        assert (routed.sum(dim=1) > 0).all() and (routed.sum(dim=1) <= budget).all()
        assert visible[b][:, prompt:prompt + 40].all() and not visible[b][:, prompt + 40:].any()
        for h in range(HKV):  # each opened region is one contiguous range of rows
            regions = key_region[b * SPAN + position[run], h][routed[h]]
            starts = routed[h].long().diff().clamp(min=0).sum() + routed[h][0].long()
            assert starts <= len(regions.unique())
    assert (routing.keys_read < routing.keys_dense).all()


def test_dense_requests_and_passes_with_prompt_rows_read_everything():
    visible, key_valid, routing = step(["chunk", None, "chunk"])
    assert torch.equal(visible[1], key_valid[1].expand(HKV, K))
    positions = torch.tensor(PROMPT).repeat_interleave(4)
    positions[0] = 5  # request 0 recomputes a prompt row (a tracked one, or a full pass)
    visible, key_valid, routing = step(["chunk"] * B, positions=positions)
    assert routing.prompt_rows.tolist() == [True] + [False] * (4 * B - 1)
    assert torch.equal(visible[0], key_valid[0].expand(HKV, K))  # every row of the pass reads every key
    assert routing.keys_read[0] == routing.keys_dense[0]  # counted as read in full
    assert routing.keys_read[2] < routing.keys_dense[2]


def prompts(count: int = 3, length: int = 150):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 300, (length + 7 * i,), generator=g).tolist() for i in range(count)]


CACHED = [dict(method="prefix-cache"), dict(method="dual-cache"), dict(method="flash-cache", tracking_budget=4,
          mask_window=8), dict(method="flash-verify", tracking_budget=4, mask_window=8),
          dict(method="elastic", mask_window=8)]


@pytest.mark.parametrize("knobs, policy", [(knobs, "chunk") for knobs in CACHED] + [(CACHED[1], "kmeans"),
                                                                                    (CACHED[2], "kmeans")],
                         ids=lambda k: k["method"] if isinstance(k, dict) else k)
def test_a_budget_of_one_is_the_dense_attention(gqa_checkpoint, knobs, policy):
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    params = dict(max_tokens=16, block_length=8, threshold=1.0, **knobs)
    dense = llm.generate(prompts(), SamplingParams(**params), use_tqdm=False)
    routed = llm.generate(prompts(), SamplingParams(kv_routing=policy, kv_budget=1.0, **params), use_tqdm=False)
    assert [o.token_ids for o in routed] == [o.token_ids for o in dense]
    assert all(o.prompt_kv_read == 1.0 for o in routed) and all(o.prompt_kv_read is None for o in dense)


# Dual-Cache with k-means regions (its full passes lay them out anew), the others with chunks
@pytest.mark.parametrize("knobs, policy", [(CACHED[3], "chunk"), (CACHED[4], "chunk"), (CACHED[1], "kmeans")],
                         ids=lambda k: k["method"] if isinstance(k, dict) else k)
def test_a_small_budget_reads_less_and_the_kernels_route_as_the_reference(gqa_checkpoint, knobs, policy):
    """The kernel path routes from the chunk summaries kept beside the cache (rewritten where a pass writes
    prompt keys) and visits only the listed key tiles: the same tokens and keys read as the reference's routing
    from the cache. Dual-cache (full and block passes), Flash-Verify (a Flash-Cache draft pass and the verify
    pass, which writes no cache) and Elastic-Cache (refresh passes over some layers): the interpreted kernels
    are slow on the CPU."""
    params = SamplingParams(max_tokens=4, block_length=4, threshold=1.0, kv_routing=policy, kv_budget=0.5,
                            **knobs)  # 4 steps: the first pass and 3 cached ones (Elastic-Cache's refresh twice)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the kernels run interpreted (conftest)
    outputs = {kernels: LLM(gqa_checkpoint, device=device, dtype="float32", kernels=kernels).generate(
        prompts(2), params, use_tqdm=False) for kernels in (False, True)}
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    assert [o.prompt_kv_read for o in outputs[True]] == [o.prompt_kv_read for o in outputs[False]]
    assert all(0 < o.prompt_kv_read <= 0.99 for o in outputs[False])  # Elastic-Cache's routed prompt is frozen too


@pytest.mark.parametrize("knobs", CACHED, ids=lambda k: k["method"])
def test_kmeans_routes_every_cached_method(gqa_checkpoint, knobs):
    """k-means regions, rebuilt and laid out region after region at each full pass (Dual-Cache's blocks,
    Elastic-Cache's refreshes), under every cached method: each request finishes having read less than its
    prompt."""
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=16, block_length=8, threshold=1.0, kv_routing="kmeans", kv_budget=0.5,
                            **knobs)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    assert all(o.error is None and len(o.token_ids) > 0 and 0 < o.prompt_kv_read < 1 for o in outputs)


def test_a_kmeans_prefill_beside_requests_on_rows_another_request_left():
    """A pass that builds a request's k-means regions reads no region of the other requests' rows: rows a longer
    k-means request left hold its regions (more than this pass has chunks; the H100 mix's out-of-bounds scatter).
    The tokens are those of a fresh engine."""
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(100, 300, (n,), generator=g).tolist()
    routed = lambda policy: SamplingParams(method="flash-cache", max_tokens=8, block_length=8, kv_routing=policy)
    long, batch = prompt(860), [prompt(200), prompt(100)]
    llm = LLM("random:llada-tiny", device="cpu", dtype="float32", kernels=False)
    llm.generate([long], routed("kmeans"), use_tqdm=False)  # its regions stay in the rows it leaves
    after = llm.generate(batch, [routed("chunk"), routed("kmeans")], use_tqdm=False)
    fresh = LLM("random:llada-tiny", device="cpu", dtype="float32", kernels=False).generate(
        batch, [routed("chunk"), routed("kmeans")], use_tqdm=False)
    assert all(o.error is None for o in after) and [o.token_ids for o in after] == [o.token_ids for o in fresh]


def test_settings_are_checked(gqa_checkpoint):
    with pytest.raises(ValueError, match="kv_routing must be None or one of"):
        SamplingParams(method="dual-cache", kv_routing="quest")
    with pytest.raises(ValueError, match=r"kv_budget must be in \(0, 1\]"):
        SamplingParams(method="dual-cache", kv_routing="chunk", kv_budget=0.0)
    with pytest.raises(ValueError, match="method 'reference' keeps no cache"):
        SamplingParams(method="reference", kv_routing="chunk")
    # `parallel` keeps the block cache on a block-causal model (tests/decoding/test_block_diffusion.py), not here
    out = LLM(gqa_checkpoint, device="cpu", dtype="float32").generate(
        prompts(1), SamplingParams(method="parallel", kv_routing="chunk"), use_tqdm=False)[0]
    assert out.error.startswith("prompt 0: kv_routing routes the KV cache's prompt keys: method 'parallel' keeps no "
                                "cache; use one of prefix-cache")
    llm = LLM(gqa_checkpoint, device="cpu", dtype="float32", batch_invariant=True)
    out = llm.generate(prompts(1), SamplingParams(method="dual-cache", kv_routing="chunk"), use_tqdm=False)[0]
    assert out.finish_reason == "error" and "not batch-invariant" in out.error


def test_a_pass_with_more_rows_than_a_generated_part_reads_in_full():
    """Every routed request of the pass has more rows than its generated part (a full pass): it cannot be pure, so
    the pass runs the dense attention and only counts its keys; one request that may be pure routes the pass."""
    build = lambda counts, policies, writes=True: PromptRouting.build(
        [100, 100], [140, 140], counts, writes, [0.1, 0.1], policies, torch.zeros(sum(counts), dtype=torch.long),
        torch.zeros(sum(counts), dtype=torch.long), torch.arange(2), torch.zeros(2), torch.zeros(2), torch.tensor)
    assert build([140, 41], ["chunk", "chunk"]).read_in_full
    assert build([140, 8], ["chunk", None]).read_in_full  # the unrouted request reads in full anyway
    assert not build([140, 40], ["chunk", "chunk"]).read_in_full
    assert not build([140, 41], ["chunk", "chunk"], writes=False).read_in_full  # a verify pass: two views
