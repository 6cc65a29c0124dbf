"""Elastic-Cache (Nguyen-Tri, Ranjan, Shen 2025): a sliding window, a drift trigger on the most-attended
tokens and a layer-aware refresh. docs/elastic_cache.md describes the published algorithm.

A sequence's first pass computes every position. Each later step queries the positions in
    window   the `mask_window` (beta) leftmost masked positions before the first eos/eot. There are no
             blocks (`block_length` is ignored), as in the published code: any window position may be
             decoded, and the window takes in the next masks to the right;
    newly    the positions decoded in the previous step;
    tracked  per layer, the `track_num` positions, among those decoded before the previous step, to which
             the window's queries gave the most softmax attention in it (summed over heads and window
             rows), united over layers (not the prompt's positions where its KV is routed: a routed prompt
             is frozen between full passes, cache/routing.py);
and reads every other position, the masks beyond the window included, from the cache: K/V and each
layer's input hidden state (`KVCache.hidden_states`). The window is decoded with the parallel threshold
rule; the LM head runs on the window's logit rows only. On an architecture with shifted logits (Dream:
column j's logits from the hidden state of column j - 1) those are the window's left neighbours, which join
the query set; their attention is the one tracked.

Drift and refresh. The reuse pass runs every layer over the query rows. At layer l it compares the tracked
rows' attention before this step's update (the queries of their cached input hidden states against the
keys as cached) with their attention after it (fresh queries against the keys with the query rows
written): the cosine over the key axis, per head, averaged over heads and tracked rows. At the first layer
l where it is below gamma (`drift_threshold`, in [0, 1]; gamma = 1 refreshes from layer 0 every step), the
sequence refreshes: layers l..L-1 run again over all its positions, layer l from its cached input hidden
states (the query rows fresh from the reuse pass, the others as last computed) against the current keys,
so every deeper layer gets K/V from current inputs.
Rows refresh from different layers in one pass: sorted by first layer, the rows active at a layer are a
prefix of the pass.

Per-position state: `newly` (changed since the cache last saw the position; all of them before the first
pass) and `tracked` (the positions whose attention the next step's drift test compares). Host reads: the
next step's query counts ride on the engine's one sync per step; the refresh pass's shape (which rows
refresh, from which layer) costs one more per step once a row is past its first pass.

Deliberate differences from the published code:
- the cosine is taken over the key axis, as the paper describes; the code takes it over the head axis;
- the refresh recomputes the output of the layer that drifted; the code starts one layer deeper, from
  that layer's stale cached inputs, so that layer's K/V of the non-query rows come out unchanged. Here a
  trigger at layer 0 is a full forward, and gamma = 1 (refresh every step) gives exactly the threshold
  rule without cache;
- the window stops at the current first eos or eot (the code: at the leftmost eos of the first step that
  decoded one, fixed from then on); tracked positions are decoded ones only (the code also admits masks
  beyond its eos cutoff); the mask id is never a candidate; temperature > 0 samples (Gumbel-max).
"""
from __future__ import annotations

import dataclasses
import functools
from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata
from ..cache.routing import cached_keys
from ..kernels.attention import ordered_attention, ordered_sum
from ..kernels.drift_cosine import drift_cosine
from ..kernels.invariant_matmul import invariant_bmm, invariant_sum
from ..models.layers import Rotary, rotary_cos_sin
from .base import DecodingMethod, check, knob
from .parallel import ThresholdSettings
from .sampling import sample_tokens
from .transfer import transfer_threshold

if TYPE_CHECKING:
    from ..batch import DecodeBatch
    from ..cache.kv_cache import KVCache
    from ..engine.model_runner import CachedPass, ModelRunner


@dataclass(frozen=True)
class ElasticSettings(ThresholdSettings):
    mask_window: int = knob(16, "the window: masked positions recomputed per step")
    drift_threshold: float = knob(0.9, "in [0, 1]: refresh from the first layer whose attention drift cosine is "
                                       "below this (1: every step, the window rule without cache)")
    track_num: int = knob(1, "most-attended decoded positions tracked per layer")

    def __post_init__(self):
        super().__post_init__()
        check(self.mask_window > 0, f"mask_window must be positive, got {self.mask_window}")
        check(0 <= self.drift_threshold <= 1, f"drift_threshold must be in [0, 1], got {self.drift_threshold}")
        check(self.track_num > 0, f"track_num must be positive, got {self.track_num}")


@dataclass
class ElasticState:
    newly: torch.Tensor    # bool
    tracked: torch.Tensor  # bool


def window_mask(tokens: torch.Tensor, gen_start: int, beta: int, mask_id: int,
                stop_ids: torch.Tensor | None) -> torch.Tensor:
    """[B, W]: the beta leftmost masked positions of each row's generated region before its first stop token."""
    width = tokens.shape[1]
    columns = torch.arange(width, device=tokens.device)
    generated = columns >= gen_start
    masked = (tokens == mask_id) & generated
    if stop_ids is not None:
        is_stop = torch.isin(tokens, stop_ids) & generated
        masked &= columns < torch.where(is_stop, columns, width).amin(dim=1, keepdim=True)
    return masked & (masked.cumsum(dim=1) <= beta)


def leading_columns(mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [B, W] -> the first k set columns of each row, ascending [B, k], padded with distinct unset
    columns, and which are set [B, k]."""
    columns = torch.argsort(~mask, dim=1, stable=True)[:, :k]
    return columns, mask.gather(1, columns)


def key_layout(keys: torch.Tensor, heads: int, ordered: bool = False) -> torch.Tensor:
    """keys [B, K, Hkv, D] -> the drift test's copy of them, one per query head (GQA: kv head j serves heads
    j*g..): [B, K, H, D] as they are in the ordered modes, whose sums run over this layout; else fp32 [B, H, D, K],
    the layout the batched GEMM reads, in one copy (einsum("bthd,bkhd->bhtk") made three: the cast, the repeat
    and its own permuted copy; at batch 32 about 1 GB a call)."""
    B, K, num_kv_heads, D = keys.shape
    if ordered:
        return keys.repeat_interleave(heads // num_kv_heads, dim=2)
    layout = torch.empty(B, num_kv_heads, heads // num_kv_heads, D, K, dtype=torch.float32, device=keys.device)
    layout.copy_(keys.permute(0, 2, 3, 1)[:, :, None])
    return layout.view(B, heads, D, K)


def set_keys(layout: torch.Tensor, request: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
             ordered: bool = False):
    """Overwrite, in a key_layout, the keys of (request[i], position[i]) with keys [N, Hkv, D]."""
    heads = layout.shape[2] if ordered else layout.shape[1]
    keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)                      # [N, H, D]
    if ordered:
        layout[request, position] = keys
    else:
        layout.permute(0, 3, 1, 2)[request, position] = keys.float()


def layer_keys(cache: KVCache, layer: int, rows: torch.Tensor) -> torch.Tensor:
    """The layer's keys at cache rows `rows` [...] -> [..., Hkv, D] in the model's dtype (an fp8 cache's
    dequantised, as the reference attention reads them)."""
    return cached_keys(cache.k[layer], cache.scales(layer).get("k_scale"), rows, cache.dtype)


def attention_rows(q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor, ordered: bool = False,
                   kernels: bool = False) -> torch.Tensor:
    """q [B, T, H, D], keys (`key_layout` of [B, K, Hkv, D], in the same mode), key_valid [B, K] -> softmax
    attention [B, H, T, K] in fp32 (by default the fp32 einsum's, bit for bit). ordered: its sums over keys in one fixed
    order (batch-invariant decoding), with `kernels` through the invariant Triton kernels (the GPU's way:
    PyTorch's batched GEMMs and scans group their sums by the shape)."""
    if ordered and kernels:
        return _invariant_attention_rows(q, keys, key_valid)
    if ordered:
        keys = keys.transpose(1, 2)
        return ordered_attention(q.transpose(1, 2), keys, torch.zeros_like(keys[..., :1]),
                                 key_valid[:, None, None, :])[1]
    scores = torch.matmul(q.float().transpose(1, 2), keys).mul_(q.shape[-1] ** -0.5)
    return scores.masked_fill_(~key_valid[:, None, None, :], float("-inf")).softmax(dim=-1)


def _invariant_attention_rows(q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """attention_rows through the invariant kernels, keys [B, K, H, D] one per query head. The key axis is the
    batch's widest row, each row's keys first: its padding gets exact zeros after the softmax (the max is exact in
    any order), which leave invariant_sum's sums as they are alone."""
    (B, T, H, D), K = q.shape, keys.shape[1]
    scores = invariant_bmm(q.transpose(1, 2).reshape(B * H, T, D), keys.permute(0, 2, 3, 1).reshape(B * H, D, K),
                           torch.float32).view(B, H, T, K) * D ** -0.5
    scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))        # 0 where not visible
    total = invariant_sum(weights)[..., None]
    return weights / total.masked_fill(total == 0, 1.0)


def drift_similarity(before: torch.Tensor, after: torch.Tensor, valid: torch.Tensor, ordered: bool = False,
                     kernels: bool = False) -> torch.Tensor:
    """before, after [B, H, T, K]: the tracked rows' attention; valid [B, T] -> [B]: their cosine over the
    key axis, averaged over heads and valid tracked rows (1, no drift, where a row tracks nothing). ordered: its
    sums over keys and tracked rows in one fixed order (batch-invariant decoding); with `kernels`, every sum,
    over heads too, through invariant_sum (padded keys and tracked rows add exact zeros)."""
    return mean_cosine(head_cosines(before, after, ordered, kernels), valid, ordered, kernels)


def head_cosines(before: torch.Tensor, after: torch.Tensor, ordered: bool = False,
                 kernels: bool = False) -> torch.Tensor:
    """drift_similarity's cosine over the key axis per head and tracked row: [B, H, T] (a tensor-parallel rank's
    heads: the ranks' are gathered before `mean_cosine`)."""
    if ordered and kernels:
        dot, before_sq, after_sq = (invariant_sum(x) for x in (before * after, before ** 2, after ** 2))
        return dot / (before_sq.sqrt() * after_sq.sqrt()).clamp(min=1e-8)
    if ordered:
        dot, before_sq, after_sq = (ordered_sum(x, dim=-1) for x in (before * after, before ** 2, after ** 2))
        return dot / (before_sq.sqrt() * after_sq.sqrt()).clamp(min=1e-8)
    return F.cosine_similarity(before, after, dim=-1)


def mean_cosine(cosine: torch.Tensor, valid: torch.Tensor, ordered: bool = False,
                kernels: bool = False) -> torch.Tensor:
    """head_cosines [B, H, T] (every head's), valid [B, T] -> drift_similarity's [B]."""
    if ordered and kernels:
        cosine = invariant_sum(cosine.transpose(1, 2)) / cosine.shape[1]                     # [B, T]
        total = invariant_sum(torch.where(valid, cosine, 0.0))
    elif ordered:
        total = ordered_sum(torch.where(valid, cosine.mean(dim=1), 0.0), dim=1)
    else:
        return mean_over_tracked(cosine.mean(dim=1), valid)
    count = valid.sum(dim=1)
    return torch.where(count > 0, total / count.clamp(min=1), 1.0)


def mean_over_tracked(cosine: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """cosine [..., B, T] (averaged over heads), valid [B, T] -> [..., B]: the mean over valid tracked rows (1 where
    none)."""
    count = valid.sum(dim=-1)
    return torch.where(count > 0, torch.where(valid, cosine, 0.0).sum(dim=-1) / count.clamp(min=1), 1.0)


def select_tracked(key_mass: torch.Tensor, decoded: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """key_mass [L, B, K >= W] by position (the window's attention per layer); decoded [B, W] by column (rows
    end at column W) -> [B, W]: per layer the k decoded positions with the most mass, united over layers."""
    num_layers, (B, width) = key_mass.shape[0], decoded.shape
    position = (torch.arange(width, device=decoded.device) - (width - lengths)[:, None]).clamp(min=0)
    mass = key_mass.gather(2, position.expand(num_layers, B, width)).masked_fill(~decoded, float("-inf"))
    top = mass.topk(min(k, width), dim=2)                                            # [L, B, k]
    index, found = top.indices.transpose(0, 1).flatten(1), top.values.isfinite().long().transpose(0, 1).flatten(1)
    return torch.zeros(B, width, dtype=torch.long, device=decoded.device).scatter_add_(1, index, found) > 0


def _prepare(runner: ModelRunner, batch: DecodeBatch, order: list[int], selected: torch.Tensor, counts: list[int],
             track: torch.Tensor) -> CachedPass:
    """A pass over the columns `selected` [B, W] of the batch rows in `order` (counts: how many each selects);
    the rows of the columns `track` [B, W] are tracked."""
    columns = leading_columns(selected[runner.constant(order)], max(counts))[0]
    return runner.prepare(batch, counts, columns, order=order, track=track)


def _leading_groups(m: AttentionMetadata, counts: list[int], groups: int) -> tuple[AttentionMetadata, int]:
    """For a pass over whole sequences (counts = lengths): the attention metadata of its first `groups`
    groups, and their number of rows."""
    n, longest = sum(counts[:groups]), max(counts[:groups])
    metadata = AttentionMetadata(cu_seqlens_q=m.cu_seqlens_q[:groups + 1], kv_start=m.kv_start[:groups],
                                 kv_len=m.kv_len[:groups], slot_mapping=m.slot_mapping[:n], max_q=longest,
                                 max_kv=longest, track_rows=m.track_rows[:n], ordered=m.ordered,
                                 routing=None if m.routing is None else m.routing.leading(groups, n))
    return metadata, n


def _reuse_pass(runner: ModelRunner, batch: DecodeBatch, reuse: CachedPass, tracked: torch.Tensor, drift: bool):
    """Every layer over the query rows. Returns their final hidden states [N, d], the window's attention mass
    per layer [L, B, max_kv >= W] (by position) and, with `drift`, the tracked rows' similarity per layer [L, B].
    With CUDA graphs, the layers and the drift test (its inputs included) replay as one graph."""
    width, m = batch.tokens.shape[1], reuse.metadata
    tracked_rows = min(runner.model.config.num_layers * batch.params.settings.track_num, width) if drift else 0
    tensors = (reuse.input_ids, reuse.positions, m.cu_seqlens_q, m.kv_start, m.kv_len, m.slot_mapping, m.track_rows,
               *((tracked, reuse.flat_of_column, reuse.request) if drift else ()))
    layers = functools.partial(_reuse_layers, runner.model, runner.cache, runner.kernels, m, width, tracked_rows)
    # Captured at its exact row count: padding rows would change the GEMMs' shapes, and cuBLAS's rounding with
    # them (2 of 100 embedded trace items decoded differently in fp32 on the H200).
    return _replayed(runner, reuse, ("elastic reuse", m.max_q, m.max_kv, width, tracked_rows), layers, tensors)


def _replayed(runner: ModelRunner, p: CachedPass, key: tuple, layers, tensors: tuple[torch.Tensor, ...],
              capture_after: int | None = None):
    """layers(*tensors) for the pass p, replayed from one CUDA graph per key and tensor shapes where the runner
    replays it (`_graphed`), captured after `capture_after` eager sightings (None: the graphs' default)."""
    if not _graphed(runner, p):
        return layers(*tensors)
    return runner.graphs.run((*key, *((tuple(t.shape), t.dtype) for t in tensors)), layers, tensors, capture_after)


def _graphed(runner: ModelRunner, p: CachedPass) -> bool:
    """Whether the pass p replays from graphs: the runner replays a pass of its rows, and it is not routed (its
    routing, its rows in the prompt, is not among a graph's inputs)."""
    return runner.uses_graphs(p.input_ids.shape[0]) and p.metadata.routing is None


def _reuse_layers(model, cache, kernels: bool, metadata: AttentionMetadata, width: int, tracked_rows: int, input_ids,
                  positions, cu_seqlens_q, kv_start, kv_len, slot_mapping, track_rows, tracked=None,
                  flat_of_column=None, row_request=None):
    """The reuse pass's layers on tensors only (a CUDA graph replays it): the metadata's host values come from
    `metadata`, its tensors are the arguments; with `tracked` [B, W], the drift test over its first `tracked_rows`
    tracked columns per row (flat_of_column [B, W]: the pass's flat row of each column; row_request [N]: each
    query row's batch row)."""
    cfg, layers, hidden, tp = model.config, model.layers, cache.hidden_states(), model.tp
    heads = model.shard_config.num_heads  # this rank's (tensor parallelism: the ranks' drift cosines are gathered)
    metadata = dataclasses.replace(metadata, cu_seqlens_q=cu_seqlens_q, kv_start=kv_start, kv_len=kv_len,
                                   slot_mapping=slot_mapping, track_rows=track_rows)
    B, drift, device = kv_start.shape[0], tracked is not None, input_ids.device
    key_mass = torch.zeros(len(layers), B, metadata.max_kv, device=device)  # by position: max_kv >= W keys
    rope = Rotary.at(positions, cfg)
    x = model.embed(input_ids)
    ordered, invariant = metadata.ordered, metadata.ordered and kernels  # invariant: the GPU's batch-invariant path
    fused = drift and kernels and not ordered  # the drift test in one kernel a layer (kernels/drift_cosine.py)
    similarity = None if fused else torch.ones(len(layers), B, device=device)  # fused: averaged after the layers
    if drift:  # the tracked rows [B, T], every row's keys [B, W] and the query rows' own key slots [N]
        t_column, t_valid = leading_columns(tracked, tracked_rows)
        t_position = (t_column - (width - kv_len)[:, None]).clamp(min=0)
        t_slot, t_flat = kv_start[:, None] + t_position, flat_of_column.gather(1, t_column).clamp(min=0)
        t_cos, t_sin = rotary_cos_sin(t_position, cfg.rotary_width, cfg.rope_theta)
        key_valid = torch.arange(width, device=device) < kv_len[:, None]
        key_slot = kv_start[:, None] + torch.where(key_valid, torch.arange(width, device=device), 0)
        row_slot = key_slot[row_request, positions]
    if fused:  # each query row's flat index at its position (the old keys' row), and both queries' rotations
        before_row = torch.full(key_slot.shape, -1, dtype=torch.long, device=device)
        before_row[row_request, positions] = torch.arange(positions.shape[0], device=device)
        t_cos, t_sin = torch.cat((t_cos, t_cos), dim=1), torch.cat((t_sin, t_sin), dim=1)
        cosines = torch.empty(len(layers), B, heads, tracked_rows, device=device)  # every layer's drift
    for index, layer in enumerate(layers):
        if fused:  # before and after queries in one projection; the keys the layer is about to rewrite
            q_before, q_after = layer.queries(torch.cat((hidden[index][t_slot], x[t_flat]), dim=1),
                                              t_cos, t_sin).chunk(2, dim=1)
            old_keys = cache.k[index][row_slot]
            scales = {} if cache.k_scale is None else dict(k_scale=cache.k_scale[index],
                                                           old_scale=cache.k_scale[index][row_slot])
        elif drift:  # before: the cached inputs' queries against the keys as cached
            keys = key_layout(layer_keys(cache, index, key_slot), heads, ordered)
            before = attention_rows(layer.queries(hidden[index][t_slot], t_cos, t_sin, invariant), keys, key_valid,
                                    ordered, kernels)
            q_after = layer.queries(x[t_flat], t_cos, t_sin, invariant)
        hidden[index][slot_mapping] = x
        x = layer.forward_cached(x, rope, metadata, cache, key_mass[index], kernels)
        if fused:
            drift_cosine(q_before, q_after, cache.k[index], kv_start, kv_len, before_row, old_keys,
                         out=cosines[index], **scales)
        elif drift:  # after: the same keys but the query rows', which the layer has just rewritten in the cache
            set_keys(keys, row_request, positions, layer_keys(cache, index, row_slot), ordered)
            after = attention_rows(q_after, keys, key_valid, ordered, kernels)
            similarity[index] = mean_cosine(tp.all_gather(head_cosines(before, after, ordered, kernels), dim=1),
                                            t_valid, ordered, kernels)
    if fused:  # averaged for all layers at once: a few launches a pass instead of ~9 a layer
        similarity = mean_over_tracked(tp.all_gather(cosines, dim=2).mean(dim=2), t_valid)
    return x, key_mass, similarity


def _refresh_pass(runner: ModelRunner, batch: DecodeBatch, first_layer: list[int], predicting: torch.Tensor,
                  key_mass: torch.Tensor) -> tuple[CachedPass, torch.Tensor] | None:
    """Recompute layers first_layer[b]..L-1 over every position of the rows b with first_layer[b] < L, each
    from its cached input hidden states at its first layer. Overwrites their key_mass rows at those layers
    (the attention of the `predicting` [B, W] rows).
    Returns the pass and its final hidden states [N, d], or None if no row refreshes. With CUDA graphs, a
    refresh whose first layers and lengths repeat replays as one graph."""
    num_layers = len(runner.model.layers)
    order = sorted((b for b, first in enumerate(first_layer) if first < num_layers), key=first_layer.__getitem__)
    if not order:
        return None
    batch.count_query_rows([row.length * (num_layers - first) // num_layers  # in full-depth rows
                            for row, first in zip(batch.rows, first_layer)])
    starts = tuple(first_layer[b] for b in order)
    lengths = [batch.rows[b].length for b in order]
    refresh = _prepare(runner, batch, order, batch.attention_mask, lengths, predicting)
    m = refresh.metadata
    row_start = runner.constant(list(starts))[refresh.rows.request]                  # [N] each row's first layer
    tensors = (refresh.positions, m.cu_seqlens_q, m.kv_start, m.kv_len, m.slot_mapping, m.track_rows, row_start,
               runner.constant(order), key_mass)
    layers = functools.partial(_refresh_layers, runner.model, runner.cache, runner.kernels, m, lengths, starts)
    # A refresh is GPU-bound (its eager launches overlap its kernels) and its first layers repeat less than the
    # reuse pass's row counts: captured only at its fourth sighting.
    x, mass = _replayed(runner, refresh, ("elastic refresh", starts, tuple(lengths)), layers, tensors, capture_after=3)
    if mass is not key_mass:  # replayed: the graph's static copy holds the refreshed layers' mass
        key_mass.copy_(mass)
    return refresh, x


def _refresh_layers(model, cache, kernels: bool, metadata: AttentionMetadata, lengths: list[int],
                    starts: tuple[int, ...], positions, cu_seqlens_q, kv_start, kv_len, slot_mapping, track_rows,
                    row_start, order, key_mass):
    """The refresh pass's layers on tensors only (a CUDA graph replays it): group g (batch row order[g], lengths[g]
    rows) joins at layer starts[g] (ascending), so the rows active at a layer are a prefix of the pass.
    Returns the final hidden states [N, d] and key_mass with the refreshed rows' layers overwritten."""
    layers, hidden = model.layers, cache.hidden_states()
    metadata = dataclasses.replace(metadata, cu_seqlens_q=cu_seqlens_q, kv_start=kv_start, kv_len=kv_len,
                                   slot_mapping=slot_mapping, track_rows=track_rows)
    rope = Rotary.at(positions, model.config)
    x = torch.zeros(positions.shape[0], model.config.hidden_size, dtype=hidden[0].dtype, device=positions.device)
    for index in range(starts[0], len(layers)):
        groups = bisect_right(starts, index)
        layer_metadata, n = _leading_groups(metadata, lengths, groups)
        if index in starts:  # rows joining here start from their cached inputs
            x = torch.where((row_start == index)[:, None], hidden[index][slot_mapping], x)
        hidden[index][slot_mapping[:n]] = x[:n]
        mass = torch.zeros(groups, layer_metadata.max_kv, device=x.device)
        x[:n] = layers[index].forward_cached(x[:n], rope[:n], layer_metadata, cache, mass, kernels)
        key_mass[index, order[:groups]] = F.pad(mass, (0, key_mass.shape[2] - layer_metadata.max_kv))
    return x, key_mass


class Elastic(DecodingMethod):
    name = "elastic"
    Settings = ElasticSettings
    handles_logit_shift = True  # the window's logit sources join its query set
    uses_cache = True
    caches_hidden_states = True
    uses_blocks = False

    def initial_state(self, length: int, device: torch.device) -> ElasticState:
        return ElasticState(newly=torch.ones(length, dtype=torch.bool, device=device),
                            tracked=torch.zeros(length, dtype=torch.bool, device=device))

    def step(self, runner: ModelRunner, batch: DecodeBatch):
        settings, tokens, state, mask_id = batch.params.settings, batch.tokens, batch.state, batch.mask_id
        B, width = tokens.shape
        window = window_mask(tokens, batch.gen_start, settings.mask_window, mask_id, batch.stop_ids)
        decoded = batch.attention_mask & (tokens != mask_id)  # before this step: the keys that may be tracked
        frozen = batch.frozen_prompt(runner.constant)
        if frozen is not None:  # a routed prompt is frozen between full passes (cache/routing.py): never tracked
            decoded &= ~frozen
        drift = not all(row.is_first_pass for row in batch.rows)  # some row is past its first pass
        counts = [row.length if row.next_query_rows is None else row.next_query_rows for row in batch.rows]
        batch.count_query_rows(counts)
        predicting = runner.logit_sources(window)  # the window itself, unless the architecture shifts its logits
        reuse = _prepare(runner, batch, list(range(B)), state.tracked | state.newly | window | predicting, counts,
                         predicting)
        x, key_mass, similarity = _reuse_pass(runner, batch, reuse, state.tracked, drift)

        win_column, win_valid = leading_columns(window, min(settings.mask_window, width))
        h = x[runner.logit_rows(reuse.flat_of_column, win_column).clamp(min=0)]              # [B, beta, d]
        if drift:
            # gamma = 1 refreshes every step, even where the cosine rounds to exactly 1
            fires = (similarity < settings.drift_threshold) | (settings.drift_threshold >= 1)
            fires &= batch.counters.steps > 0                                                # [L, B]
            first_layer = torch.where(fires.any(dim=0), fires.int().argmax(dim=0), fires.shape[0])
            refreshed = _refresh_pass(runner, batch, first_layer.tolist(), predicting, key_mass)  # 2nd host read
            if refreshed is not None:
                refresh, x_refresh = refreshed
                rows = runner.logit_rows(refresh.flat_of_column, win_column)
                h = torch.where((rows >= 0)[..., None], x_refresh[rows.clamp(min=0)], h)

        tensors = (h, win_column, win_valid, key_mass, decoded)
        decode = functools.partial(_decode_window, runner, batch)
        if runner.graphs is None:
            next_query_rows, = decode(*tensors)
        else:  # one launch instead of ~50 small ones (batch 1 is launch-bound here); it reads the batch in place
            key = ("elastic decode", batch.number, *((tuple(t.shape), t.dtype) for t in tensors))
            next_query_rows, = runner.graphs.run(key, decode, tensors)
        batch.next_query_rows = next_query_rows


def _decode_window(runner: ModelRunner, batch: DecodeBatch, h: torch.Tensor, win_column: torch.Tensor,
                   win_valid: torch.Tensor, key_mass: torch.Tensor, decoded: torch.Tensor) -> tuple[torch.Tensor]:
    """The step after its passes, on tensors (a CUDA graph replays it over its batch): the window's [B, beta]
    logits from its final hidden states h [B, beta, d], the threshold rule's transfer into the tokens, the next
    step's newly decoded and tracked positions (the batch's state, written in place) and the counters. Returns each
    row's query rows of the next step [B]."""
    settings, tokens, state, mask_id = batch.params.settings, batch.tokens, batch.state, batch.mask_id
    logits = runner.model.compute_logits(runner.model.final_norm(h))  # the sampler upcasts to float64
    candidates, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.counters.steps,
                                           win_column - batch.gen_start, sample=batch.is_sampling,
                                           mask_id=mask_id, kernels=runner.kernels)
    transfer = transfer_threshold(confidence.masked_fill(~win_valid, float("-inf")), win_valid, batch.rule_value)
    tokens.scatter_(1, win_column, torch.where(transfer, candidates, tokens.gather(1, win_column)))

    state.newly.zero_().scatter_(1, win_column, transfer)
    state.tracked.copy_(select_tracked(key_mass, decoded, batch.lengths, settings.track_num))
    next_window = window_mask(tokens, batch.gen_start, settings.mask_window, mask_id, batch.stop_ids)
    next_queries = state.tracked | state.newly | next_window | runner.logit_sources(next_window)
    batch.counters.steps += 1
    batch.counters.nfe += 1
    return (next_queries.sum(dim=1),)
