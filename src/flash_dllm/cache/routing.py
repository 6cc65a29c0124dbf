"""Routing of a long prompt's KV (issue 17): each step, per layer, request and KV head, only the prompt's key
chunks that the step's queries may need are read; the generated part stays dense.

The prompt's positions are cut into chunks of CHUNK keys. Each step scores a request's chunks with all of its
query rows and all query heads of a KV head (one routing shared by the step's rows), and opens the top chunks
within its budget, plus the attention sinks (the first SINKS positions) and a recent window (the prompt's last
WINDOW positions), which are always open. Policies (`SamplingParams.kv_routing`):
    chunk     a chunk's score is the upper bound of any of its keys' scores (per-dimension min/max, as Quest
              scores pages): sum_d max(q_d * lo_d, q_d * hi_d), the largest over rows and heads;
    centroid  its mean key's score;
    kmeans    k-means regions instead of chunks (cache/regions.py: about CHUNK keys each, similar keys wherever
              they are), scored by their bounds, opened best first while the keys read stay within the budget
              (never above it: at most the chunks' bytes); built when a pass writes a request's whole sequence
              (a prefill, Dual-Cache's full pass, Elastic-Cache's refreshed layers), and the keys then laid out
              region after region per KV head, so that an opened region is one contiguous range of rows;
    window    the chunks nearest the prompt's end (a control: recency alone);
    random    a fixed pseudo-random order per (layer, KV head, chunk) (a control at equal bytes).
A request's budget (`kv_budget`, a fraction of its prompt's keys) counts the sinks and the window. A routed
prompt is frozen between full passes: no method recomputes its positions in a step (Flash-Cache and
Elastic-Cache track only generated positions; routed, recomputed prompt keys drift from the prompt's meaning:
passkey retrieval failed with Flash-Cache's tracked prompt rows routed). A pass with rows in the request's prompt
(a full pass; on an architecture with shifted logits, the prompt's last position) reads its keys in full, for
every row.

Chunks are the cache's own (requests start at multiples of CHUNK rows, kv_cache.ALIGN). `route` is the
reference: it summarises the chunks from the cache at every step. `route_stored` reads the summaries kept beside
the cache (KVCache.chunk_summaries), which kernels/chunk_summaries.py rewrites for the chunks that a pass's
prompt rows write; the attention kernel then visits only the open chunks. What does not depend on the layer is
computed once per pass (`PassKeys`): a step's routing is a handful of launches per layer. K-means regions are
kept beside the cache too (KVCache.kmeans_regions: summaries, each row's region, sizes), built in PyTorch and
routed by the same kernels; in their region-ordered layout the kernel's list of key tiles holding an opened key
is about the opened keys' own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.kv_fp8 import dequantize_kv
from .attention_metadata import padded_index
from .regions import kmeans_assignment, region_summaries

CHUNK, SINKS, WINDOW = 32, 4, 32
# `random`'s order of (chunk, KV head, layer): (chunk * A + head * B + layer * C) % M (kernels/route_chunks.py too)
RANDOM_HASH = dict(chunk=1103515245, head=12345, layer=2654435761, modulus=2147483647)
POLICIES = ("chunk", "centroid", "kmeans", "window", "random")


@dataclass
class PassKeys:
    """The layer-independent part of a pass's routing, for its requests' cache ranges padded to K keys."""

    in_prompt: torch.Tensor   # [B, K] bool: the request's prompt keys
    routable: torch.Tensor    # [B, K] bool: prompt keys outside the sinks and the window (read only when opened)
    competes: torch.Tensor    # [B, C] bool: chunks holding routable keys
    always: torch.Tensor      # [B, 1, K] bool: keys read whatever the scores (all of them: dense, or not pure)
    chunk_of: torch.Tensor    # [B, Hkv, K] long: each key's chunk
    q_index: torch.Tensor     # [B, R] long: the rows that score (a pure request's rows; R <= its rows)
    q_valid: torch.Tensor     # [B, R] bool
    dense_count: torch.Tensor  # [B] long: prompt keys x KV heads
    cache_chunk: torch.Tensor  # [B, C] long: the cache's chunk of each of the request's chunks
    key_index: torch.Tensor    # [B, K] long: the cache row of each key (clamped into the range)


@dataclass
class PromptRouting:
    """Per request of a pass: which keys of its cache range are its prompt, how many chunks it opens and how they
    are scored; also where the keys each step reads are counted. Requests without routing open every chunk."""

    prompt_len: torch.Tensor   # [B] long: keys [0, prompt_len) of the request's cache range are routed
    top_k: torch.Tensor        # [B] long: chunks opened besides the sinks and the window
    policy: torch.Tensor       # [B] long: index into POLICIES, -1 = dense
    policies: tuple[str, ...]  # the policies present (host: only their scores are computed)
    max_top_k: int             # the largest top_k (a host number: the top-k's width)
    max_routed_rows: int       # an upper bound of a pure request's rows (its generated part's length)
    read_in_full: bool         # a pass that writes the cache where no request can be pure (each has more rows
                               # than its generated part) or routed: it reads every key unrouted, only counting
    row_request: torch.Tensor  # [N] long: each query row's request
    prompt_rows: torch.Tensor  # [N] bool: the pass's rows in their request's prompt
    pure: torch.Tensor         # [B] bool: the pass has no prompt row of the request (it reads its prompt routed)
    rebuilds: torch.Tensor     # [B] bool: a kmeans request whose whole sequence the pass writes (its regions
                               # summarised and laid out anew)
    rebuilding: tuple[bool, ...]  # host: `rebuilds`
    recluster_lengths: tuple[int, ...]  # host: of those, one without regions yet (its prefill), where k-means runs:
                                        # its sequence's length (else 0)
    recluster_index: torch.Tensor  # [requests with a length above] long: their indices, ascending
    batch_row: torch.Tensor    # [B] long: each request's row of the decode batch (the accumulators' index)
    keys_read: torch.Tensor    # [batch rows] long: prompt keys read, summed over passes, layers and KV heads
    keys_dense: torch.Tensor   # [batch rows] long: the same, had every prompt key been read
    pass_keys: PassKeys | None = field(default=None, init=False)  # computed by the pass's first layer
    written: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)  # and `written_chunks`

    @classmethod
    def build(cls, prompt_lens: list[int], lengths: list[int], row_counts: list[int], writes_cache: bool,
              budgets: list[float], policies: list[str | None], row_request: torch.Tensor, positions: torch.Tensor,
              batch_row: torch.Tensor, keys_read: torch.Tensor, keys_dense: torch.Tensor, constant,
              clustered: list[bool] | None = None) -> PromptRouting:
        """Per request: prompt and sequence lengths, query rows in the pass, budget and policy; whether the pass
        writes the cache (a verify pass may hold two views of a position); row_request, positions [N]: each query
        row's request and position. `constant`: host list -> device tensor (the runner's, which keeps repeating
        lists on the device). A budget of 1 reads every key: such a request is dense (its keys still counted), and
        builds no k-means regions (its steps may recompute prompt positions, which the regions' layout forbids).
        `clustered`: per request, whether its k-means regions exist (a full pass after its prefill keeps their
        keys' assignment: k-means runs once per request; default: none exist)."""
        # a dense request (no policy, no budget) may share the batch of routed ones: its keys are counted only
        policies = [policy if policy is not None and budget < 1 else None for policy, budget in zip(policies, budgets)]
        top_k = [chunks_opened(length, budget) if policy else 0
                 for length, budget, policy in zip(prompt_lens, budgets, policies)]
        prompt_len = constant(prompt_lens)
        prompt_rows = positions < prompt_len[row_request]
        counts = torch.zeros_like(prompt_len).index_add_(0, row_request, prompt_rows.long())
        rebuilds = tuple(writes_cache and policy == "kmeans" and rows >= length
                         for policy, rows, length in zip(policies, row_counts, lengths))
        recluster_lengths = tuple(length if rebuild and not built else 0 for rebuild, built, length
                                  in zip(rebuilds, clustered or [False] * len(rebuilds), lengths))
        return cls(prompt_len, constant(top_k), constant([POLICIES.index(p) if p else -1 for p in policies]),
                   tuple(sorted({p for p in policies if p}, key=POLICIES.index)), max(top_k),
                   max(length - prompt for length, prompt in zip(lengths, prompt_lens)),
                   writes_cache and all(not policy or rows > length - prompt
                                        for policy, rows, length, prompt in zip(policies, row_counts, lengths,
                                                                                prompt_lens)),
                   row_request, prompt_rows, counts == 0, constant(list(rebuilds)).bool(), rebuilds,
                   recluster_lengths, constant([b for b, length in enumerate(recluster_lengths) if length]),
                   batch_row, keys_read, keys_dense)

    def leading(self, groups: int, rows: int) -> PromptRouting:
        """The routing of a pass's first `groups` requests, which own its first `rows` query rows."""
        return dataclasses.replace(
            self, prompt_len=self.prompt_len[:groups], top_k=self.top_k[:groups], policy=self.policy[:groups],
            row_request=self.row_request[:rows], prompt_rows=self.prompt_rows[:rows], pure=self.pure[:groups],
            rebuilds=self.rebuilds[:groups], rebuilding=self.rebuilding[:groups],
            recluster_lengths=self.recluster_lengths[:groups],
            recluster_index=self.recluster_index[:sum(map(bool, self.recluster_lengths[:groups]))],
            batch_row=self.batch_row[:groups])

    @property
    def any_rebuild(self) -> bool:
        return any(self.rebuilding)

    def keys_of_pass(self, metadata, num_kv_heads: int) -> PassKeys:
        if self.pass_keys is None:
            self.pass_keys = _pass_keys(self, metadata, num_kv_heads)
        return self.pass_keys

    def written_chunks(self, metadata, scratch_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row of a pass that writes the cache: the cache chunk whose prompt keys it writes (-1: none,
        it is not a prompt row or its K/V go to the scratch row) and the end of its request's prompt in cache
        rows (kernels/chunk_summaries.py's arguments)."""
        if self.written is None:
            slots = metadata.slot_mapping
            self.written = (torch.where(self.prompt_rows & (slots != scratch_row), slots // CHUNK, -1),
                            metadata.kv_start[self.row_request] + self.prompt_len[self.row_request])
        return self.written


def chunks_opened(prompt_len: int, budget: float) -> int:
    """Chunks a request opens besides its sinks and window: its budget of keys, less those, in whole chunks (a
    budget of 1: every chunk, the dense attention)."""
    if budget >= 1:
        return -(-prompt_len // CHUNK)
    always = min(prompt_len, SINKS + WINDOW)
    return max(0, (int(budget * prompt_len) - always) // CHUNK)


def _pass_keys(routing: PromptRouting, metadata, num_kv_heads: int) -> PassKeys:
    K = metadata.max_kv
    C = -(-K // CHUNK)
    positions = torch.arange(K, device=routing.prompt_len.device)
    key_valid = positions < metadata.kv_len[:, None]
    in_prompt = (positions < routing.prompt_len[:, None]) & key_valid
    routable = in_prompt & (positions >= SINKS) & (positions < routing.prompt_len[:, None] - WINDOW)
    competes = F.pad(routable, (0, C * CHUNK - K)).view(-1, C, CHUNK).any(dim=2)
    dense = ((routing.policy < 0) | ~routing.pure)[:, None]
    always = (~routable | dense) & key_valid
    # Only a pure request's rows score, and a pass that writes the cache has no more of them than its generated
    # part (a verify pass may hold two views of a position).
    q_begin = metadata.cu_seqlens_q[:-1]
    width = min(metadata.max_q, routing.max_routed_rows) if metadata.write_cache else metadata.max_q
    q_index, q_valid = padded_index(q_begin, (metadata.cu_seqlens_q[1:] - q_begin).clamp(max=width), width)
    B = key_valid.shape[0]
    cache_chunk = metadata.kv_start[:, None] // CHUNK + torch.arange(C, device=positions.device)
    key_index = padded_index(metadata.kv_start, metadata.kv_len, K)[0]
    return PassKeys(in_prompt, routable, competes, always[:, None, :], (positions // CHUNK).expand(B, num_kv_heads, K),
                    q_index, q_valid & routing.pure[:, None], in_prompt.sum(dim=1) * num_kv_heads, cache_chunk,
                    key_index)


def count_in_full(metadata, num_kv_heads: int):
    """A pass that reads every key (`read_in_full`): count its prompt keys as read, for one layer."""
    routing = metadata.routing
    dense = torch.minimum(routing.prompt_len, metadata.kv_len) * num_kv_heads
    routing.keys_read.index_add_(0, routing.batch_row, dense)
    routing.keys_dense.index_add_(0, routing.batch_row, dense)


def update_kmeans(k_cache: torch.Tensor, v_cache: torch.Tensor, summaries: torch.Tensor, key_region: torch.Tensor,
                  region_size: torch.Tensor, assignment: torch.Tensor, metadata, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None):
    """After a pass wrote the layer's cache: the kmeans requests whose whole sequence it wrote get their k-means
    regions anew (KVCache.kmeans_regions' layer entries: each region's summary, each cache row's region per KV
    head, each region's size, each position's region). At a request's prefill k-means groups its routable
    prompt keys; a later full pass (Dual-Cache's blocks, Elastic-Cache's refreshes) keeps that grouping (the
    keys drift little; k-means costs ~30 ms a layer at 8k keys on an H200) and summarises its new keys. Either
    way the keys are then laid out region after region, per KV head, in K and V (`region_layout`; the pass wrote
    them in position order): a step that opens a region reads one contiguous range of rows. No other pass writes
    a kmeans request's routable keys (the others write its generated part, or the last prompt positions, which
    stay where they are; a routed prompt is never recomputed in a step), so the layout holds until the next full
    pass. k_scale, v_scale [rows, Hkv] fp32: an fp8 cache's (its keys grouped dequantised; the scales move with
    their rows)."""
    routing = metadata.routing
    if not routing.any_rebuild:
        return
    Hkv, D = k_cache.shape[1:]
    keys = routing.keys_of_pass(metadata, Hkv)
    B, K = keys.key_index.shape
    grouped = cached_keys(k_cache, k_scale, keys.key_index).transpose(1, 2).reshape(B * Hkv, K, D)
    # Only a rebuilding request's rows hold its own regions; the others' may hold those of a request that left
    # (of more regions than this pass has chunks).
    kept = keys.routable[:, None, :] & routing.rebuilds[:, None, None]
    assign = assignment[keys.key_index].long().transpose(1, 2).masked_fill(~kept, -1)
    if any(routing.recluster_lengths):
        # k-means over those requests' own keys, not the pass's widest range: its sequential seeding and its
        # similarities grow with the width, and the regions are the same (keys past a group's valid ones are unused)
        index, width = routing.recluster_index, max(routing.recluster_lengths)
        own = grouped.view(B, Hkv, K, D)[index, :, :width].flatten(0, 1)
        valid = keys.routable[index, :width].repeat_interleave(Hkv, dim=0)
        assign[index, :, :width] = kmeans_assignment(own, CHUNK, valid).view(len(index), Hkv, width)
    C = keys.cache_chunk.shape[1]
    centroids, lower, upper, sizes = region_summaries(grouped, assign.flatten(0, 1), C)
    parts = torch.stack([lower, upper, centroids], dim=1).view(B, Hkv, 3, C, D).permute(0, 3, 2, 1, 4)
    in_range = torch.arange(C, device=k_cache.device) * CHUNK < metadata.kv_len[:, None]
    scratch = summaries.shape[0] - 1  # written where nothing is: the requests that do not rebuild
    chunk = torch.where(routing.rebuilds[:, None] & in_range, keys.cache_chunk, scratch)            # [B, C]
    summaries[chunk] = torch.nan_to_num(parts, posinf=0.0, neginf=0.0).to(summaries.dtype)        # empty: zeros
    region_size[chunk] = sizes.view(B, Hkv, C).transpose(1, 2).to(region_size.dtype)
    order = region_layout(assign, keys.routable)                                                  # [B, Hkv, K]
    key_valid = torch.arange(K, device=k_cache.device) < metadata.kv_len[:, None]
    rows = torch.where(routing.rebuilds[:, None] & key_valid, keys.key_index, key_region.shape[0] - 1)  # [B, K]
    assignment[rows] = assign.transpose(1, 2).to(assignment.dtype)
    heads = torch.arange(Hkv, device=k_cache.device)[:, None]
    source = keys.key_index[:, None, :].expand(B, Hkv, K).gather(2, order) * Hkv + heads         # [B, Hkv, K]
    target = rows[:, None, :] * Hkv + heads
    for cache in (k_cache, v_cache, *(scale[..., None] for scale in (k_scale, v_scale) if scale is not None)):
        flat = cache.view(-1, cache.shape[-1])
        flat[target.flatten()] = flat[source.flatten()]
    key_region.view(-1)[target.flatten()] = assign.gather(2, order).flatten().to(key_region.dtype)


def region_layout(assign: torch.Tensor, routable: torch.Tensor) -> torch.Tensor:
    """assign [B, Hkv, K] (each key's region, -1: none), routable [B, K] bool (a contiguous run of positions) ->
    [B, Hkv, K] long: the key each position holds in the region-ordered layout: the routable run holds its keys
    region after region (by position within a region); every other position keeps its key."""
    K = assign.shape[-1]
    position = torch.arange(K, device=assign.device)
    first = routable.long().argmax(dim=1)[:, None, None]  # the run's first position (0: no run)
    rank = torch.where(routable[:, None, :], K + assign, position + torch.where(position < first, 0, 2 * K))
    return rank.sort(dim=-1, stable=True).indices


def kmeans_inputs(state: tuple[torch.Tensor, ...] | None, keys: PassKeys):
    """The pass's view of a layer's k-means regions (KVCache.kmeans_regions'): the regions' lower and
    upper bounds {0, 1: [B, C, Hkv, D]}, each key's region [B, Hkv, K] (-1: none) and each region's size
    [B, Hkv, C]; None without kmeans requests."""
    if state is None:
        return None
    summaries, key_region, region_size = state[:3]
    chunk = keys.cache_chunk.clamp(max=summaries.shape[0] - 1)
    return ({part: summaries[:, part][chunk].float() for part in (0, 1)},
            key_region[keys.key_index].long().transpose(1, 2), region_size[chunk].long().transpose(1, 2))


def cached_keys(k_cache: torch.Tensor, k_scale: torch.Tensor | None, index: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The keys of cache rows `index` [...] -> [..., Hkv, D]: as cached, or dequantised to `dtype` from an fp8 cache
    (k_scale [rows, Hkv] fp32)."""
    return k_cache[index] if k_scale is None else dequantize_kv(k_cache[index], k_scale[index], dtype)


def route(q: torch.Tensor, k_cache: torch.Tensor, metadata, layer: int,
          kmeans: tuple[torch.Tensor, ...] | None = None, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D] a pass's rotated queries, k_cache [rows, Hkv, D] the layer's cache (already holding the
    pass's keys) -> [B, Hkv, max_kv] bool: the cache keys each request's KV head reads (`visible_keys`), its
    chunks summarised from the cache; `kmeans`: the layer's k-means regions, where the pass has kmeans requests.
    k_scale [rows, Hkv] fp32: an fp8 cache's."""
    keys = metadata.routing.keys_of_pass(metadata, k_cache.shape[1])
    scored = {"chunk", "centroid"} & set(metadata.routing.policies)  # the others read no chunk summary
    summaries = summarise(cached_keys(k_cache, k_scale, keys.key_index), keys.in_prompt) if scored else {}
    return visible_keys(q, summaries, metadata, layer, num_kv_heads=k_cache.shape[1],
                        kmeans=kmeans_inputs(kmeans, keys))


def route_stored(q: torch.Tensor, summaries: torch.Tensor, metadata, layer: int,
                 kmeans: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """As `route`, with the chunk summaries kept beside the cache: summaries [cache rows / CHUNK, 3, Hkv, D]
    (the layer's KVCache.chunk_summaries, fresh for the pass's prompt rows). No prompt key is read; of the
    summaries, only those the pass's policies score."""
    keys = metadata.routing.keys_of_pass(metadata, summaries.shape[2])
    # A range shorter than the pass's widest may end near the cache's end: its chunks past its keys are unread.
    chunk = keys.cache_chunk.clamp(max=summaries.shape[0] - 1)
    policies = metadata.routing.policies
    picked = {index: summaries[:, index][chunk].float() for name, parts in (("chunk", (0, 1)), ("centroid", (2,)))
              if name in policies for index in parts}
    return visible_keys(q, picked, metadata, layer, num_kv_heads=summaries.shape[2], kmeans=kmeans_inputs(kmeans, keys))


def summarise(keys: torch.Tensor, member: torch.Tensor) -> dict[int, torch.Tensor]:
    """keys [B, K, Hkv, D], member [B, K] bool -> {0: lower bounds, 1: upper bounds, 2: mean} [B, C, Hkv, D]
    fp32 of the member keys of each chunk of CHUNK keys (zeros for a chunk with none)."""
    B, K, Hkv, D = keys.shape
    C = -(-K // CHUNK)
    pad = C * CHUNK - K
    chunked = F.pad(keys.float(), (0, 0, 0, 0, 0, pad)).view(B, C, CHUNK, Hkv, D)
    inside = F.pad(member, (0, pad)).view(B, C, CHUNK, 1, 1)
    count = inside.sum(dim=2)                                                               # [B, C, 1, 1]
    finite = lambda t: torch.where(count > 0, t, 0.0)
    return {0: finite(torch.where(inside, chunked, float("inf")).amin(dim=2)),
            1: finite(torch.where(inside, chunked, float("-inf")).amax(dim=2)),
            2: torch.where(inside, chunked, 0.0).sum(dim=2) / count.clamp(min=1)}


def visible_keys(q: torch.Tensor, summaries: dict[int, torch.Tensor], metadata, layer: int,
                 num_kv_heads: int | None = None, kmeans=None) -> torch.Tensor:
    """q [N, H, D] the pass's rotated queries; summaries: those of `summarise` that the pass's policies score,
    [B, C, Hkv, D] each; kmeans: `kmeans_inputs` where the pass has kmeans requests -> [B, Hkv, K] bool: the
    keys each request's KV head reads this step (all of the generated part; of the prompt, the open regions,
    the sinks and the window; everything where the request is dense or its pass not pure). Adds the prompt keys
    read to routing.keys_read."""
    routing = metadata.routing
    Hkv = num_kv_heads or next(iter(summaries.values())).shape[2]
    keys = routing.keys_of_pass(metadata, Hkv)
    B, C = keys.competes.shape
    group, D = q.shape[1] // Hkv, q.shape[2]
    scores = {}
    if {"chunk", "centroid", "kmeans"} & set(routing.policies):
        rows = q[keys.q_index].float().masked_fill(~keys.q_valid[:, :, None, None], 0.0)    # [B, R, H, D]
        rows = rows.view(B, -1, Hkv, group, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
        row_valid = keys.q_valid[:, None, :, None].expand(B, 1, -1, group).reshape(B, 1, -1, 1)
        best = lambda s: s.masked_fill(~row_valid, float("-inf")).amax(dim=2)               # [B, Hkv, C]
        per_chunk = lambda part: summaries[part].transpose(1, 2).transpose(-1, -2)          # [B, Hkv, D, C]
        # the upper bound of a region's key scores: sum_d max(q_d * lo_d, q_d * hi_d)
        bound = lambda lower, upper: best(rows.clamp(min=0) @ upper + rows.clamp(max=0) @ lower)
        if "chunk" in routing.policies:
            scores["chunk"] = bound(per_chunk(0), per_chunk(1))
        if "centroid" in routing.policies:
            scores["centroid"] = best(rows @ per_chunk(2))
        if "kmeans" in routing.policies:
            per_region = lambda part: kmeans[0][part].transpose(1, 2).transpose(-1, -2)
            scores["kmeans"] = bound(per_region(0), per_region(1))
    chunk_index = torch.arange(C, device=q.device, dtype=torch.float32)
    if "window" in routing.policies:
        scores["window"] = chunk_index.expand(B, Hkv, C)
    if "random" in routing.policies:
        head = torch.arange(Hkv, device=q.device)[:, None]
        shuffled = (chunk_index.long() * RANDOM_HASH["chunk"] + head * RANDOM_HASH["head"]
                    + layer * RANDOM_HASH["layer"]) % RANDOM_HASH["modulus"]
        scores["random"] = shuffled.float().expand(B, Hkv, C)
    if not scores:  # every request dense (a budget of 1): nothing competes
        score = torch.zeros(B, Hkv, C, device=q.device)
    elif len(scores) == 1:
        score = next(iter(scores.values()))
    else:  # each request its own policy's
        index = torch.tensor([POLICIES.index(p) for p in scores], device=q.device)
        pick = (routing.policy.clamp(min=0)[:, None] == index).float().argmax(dim=1)        # [B]
        score = torch.stack(list(scores.values())).gather(0, pick[None, :, None, None].expand(1, B, Hkv, C))[0]
    width = min(max(routing.max_top_k, 1), C)
    # the best chunks first, equal scores in chunk order (kernels/route_chunks.py's rule)
    ranked = score.masked_fill(~keys.competes[:, None, :], float("-inf")).sort(dim=-1, descending=True, stable=True)
    top_values, top_indices = ranked.values[..., :width], ranked.indices[..., :width]
    take = (torch.arange(width, device=q.device) < routing.top_k[:, None, None]) & (top_values > float("-inf"))
    opened = torch.zeros(B, Hkv, C, dtype=torch.bool, device=q.device).scatter_(-1, top_indices, take)
    region_of = keys.chunk_of
    if kmeans is not None:  # regions of any size, opened best first while within the budget of keys
        is_kmeans = (routing.policy == POLICIES.index("kmeans"))[:, None, None]
        region_of = torch.where(is_kmeans, kmeans[1], region_of)
        # a range shorter than the pass's widest: its entries past its keys are another range's
        sizes = kmeans[2].masked_fill(torch.arange(C, device=q.device) * CHUNK >= metadata.kv_len[:, None, None], 0)
        ranked = score.masked_fill(sizes == 0, float("-inf")).sort(dim=-1, descending=True, stable=True)
        ranked_sizes = sizes.gather(-1, ranked.indices)
        fits = (ranked_sizes.cumsum(dim=-1) <= (routing.top_k * CHUNK)[:, None, None]) & (ranked.values > float("-inf"))
        by_budget = torch.zeros_like(opened).scatter_(-1, ranked.indices, fits)
        opened = torch.where(is_kmeans, by_budget, opened)
    visible = (opened.gather(-1, region_of.clamp(min=0)) & keys.routable[:, None, :] & (region_of >= 0)) | keys.always
    read = (visible & keys.in_prompt[:, None, :]).sum(dim=(1, 2))                          # non-pure: in full
    routing.keys_read.index_add_(0, routing.batch_row, read)
    routing.keys_dense.index_add_(0, routing.batch_row, keys.dense_count)
    return visible
