"""Elastic-Cache (Nguyen-Tri, Ranjan, Shen 2025): a sliding window, a drift trigger on the most-attended
tokens and a layer-aware refresh. docs/elastic_cache.md describes the published algorithm.

A sequence's first pass computes every position. Each later step queries the positions in
    window   the `mask_window` (beta) leftmost masked positions before the first eos/eot. There are no
             blocks (`block_length` is ignored), as in the published code: any window position may be
             decoded, and the window takes in the next masks to the right;
    newly    the positions decoded in the previous step;
    tracked  per layer, the `track_num` positions, among those decoded before the previous step, to which
             the window's queries gave the most softmax attention in it (summed over heads and window
             rows), united over layers;
and reads every other position, the masks beyond the window included, from the cache: K/V and each
layer's input hidden state (`KVCache.hidden_states`). The window is decoded with the parallel threshold
rule; the LM head runs on the window rows only.

Drift and refresh. The reuse pass runs every layer over the query rows. At layer l it compares the tracked
rows' attention before this step's update (the queries of their cached input hidden states against the
keys as cached) with their attention after it (fresh queries against the keys with the query rows
written): the cosine over the key axis, per head, averaged over heads and tracked rows. At the first layer
l where it is below gamma (`drift_threshold`), the sequence refreshes: layers l..L-1 run again over all its
positions, layer l from its cached input hidden states (the query rows fresh from the reuse pass, the
others as last computed) against the current keys, so every deeper layer gets K/V from current inputs.
Rows refresh from different layers in one pass: sorted by first layer, the rows active at a layer are a
prefix of the pass.

Host reads: the next step's query counts ride on the engine's one sync per step; the refresh pass's shape
(which rows refresh, from which layer) costs one more per step once a row is past its first pass.

Deliberate differences from the published code:
- the cosine is taken over the key axis, as the paper describes; the code takes it over the head axis;
- the refresh recomputes the output of the layer that drifted; the code starts one layer deeper, from
  that layer's stale cached inputs, so that layer's K/V of the non-query rows come out unchanged. Here a
  trigger at layer 0 is a full forward, and gamma > 1 gives exactly the threshold rule without cache;
- the window stops at the current first eos or eot (the code: at the leftmost eos of the first step that
  decoded one, fixed from then on); tracked positions are decoded ones only (the code also admits masks
  beyond its eos cutoff); the mask id is never a candidate; temperature > 0 samples (Gumbel-max).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.block_table import BlockTable, cu_seqlens, device_tensor, flat_rows
from ..cache.kv_cache import KVCache
from ..engine.batch import DecodeBatch
from ..models.llada import Rotary, apply_rotary, rotary_cos_sin
from .sampling import sample_tokens
from .transfer import transfer_threshold


def initial_position_state(length: int, device) -> dict[str, torch.Tensor]:
    """`newly`: changed since the cache last saw the position (all of them before the first pass);
    `tracked`: the positions whose attention the next step's drift test compares."""
    return {"newly": torch.ones(length, dtype=torch.bool, device=device),
            "tracked": torch.zeros(length, dtype=torch.bool, device=device)}


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


def attention_rows(q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D], keys [B, K, Hkv, D], key_valid [B, K] -> softmax attention [B, H, T, K] in fp32."""
    keys = keys.repeat_interleave(q.shape[2] // keys.shape[2], dim=2)  # GQA: kv head j serves heads j*g..
    scores = torch.einsum("bthd,bkhd->bhtk", q.float(), keys.float()) * q.shape[-1] ** -0.5
    return scores.masked_fill(~key_valid[:, None, None, :], float("-inf")).softmax(dim=-1)


def drift_similarity(before: torch.Tensor, after: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """before, after [B, H, T, K]: the tracked rows' attention; valid [B, T] -> [B]: their cosine over the
    key axis, averaged over heads and valid tracked rows (1, no drift, where a row tracks nothing)."""
    cosine = F.cosine_similarity(before, after, dim=-1).mean(dim=1)                  # [B, T]
    count = valid.sum(dim=1)
    return torch.where(count > 0, torch.where(valid, cosine, 0.0).sum(dim=1) / count.clamp(min=1), 1.0)


def select_tracked(key_mass: torch.Tensor, decoded: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """key_mass [L, B, K >= W] by position (the window's attention per layer); decoded [B, W] by column (rows
    end at column W) -> [B, W]: per layer the k decoded positions with the most mass, united over layers."""
    num_layers, (B, width) = key_mass.shape[0], decoded.shape
    position = (torch.arange(width, device=decoded.device) - (width - lengths)[:, None]).clamp(min=0)
    mass = key_mass.gather(2, position.expand(num_layers, B, width)).masked_fill(~decoded, float("-inf"))
    top = mass.topk(min(k, width), dim=2)                                            # [L, B, k]
    index, found = top.indices.transpose(0, 1).flatten(1), top.values.isfinite().long().transpose(0, 1).flatten(1)
    return torch.zeros(B, width, dtype=torch.long, device=decoded.device).scatter_add_(1, index, found) > 0


@dataclass
class _Pass:
    """The flat rows of one cached pass, by group: group g is batch row order[g] (rows cu_seqlens_q[g]:[g + 1])."""
    order: torch.Tensor   # [G]
    counts: list[int]     # rows per group
    row: torch.Tensor     # [N] batch row
    column: torch.Tensor  # [N]
    slot: torch.Tensor    # [N] KV-cache row
    rope: Rotary
    flat: torch.Tensor    # [B, W] the flat row of each (batch row, column), -1 where the pass has none
    table: BlockTable     # track_rows: the window rows

    @classmethod
    def build(cls, model, batch: DecodeBatch, order: list[int], selected: torch.Tensor, counts: list[int],
              window: torch.Tensor) -> _Pass:
        """The columns `selected` [B, W] of the batch rows in `order`; counts: how many each row selects."""
        device, width = batch.tokens.device, batch.tokens.shape[1]
        order_t = device_tensor(order, device)
        num_rows, cu = sum(counts), cu_seqlens(counts, device)
        group, rank = flat_rows(counts, cu)
        chosen = leading_columns(selected[order_t], max(counts))[0]
        column = chosen[group, rank]
        row = order_t[group]
        position = column - (width - batch.lengths)[row]
        slot = batch.cache_base[row] + position
        rope = Rotary.at(position, model.config)
        max_kv = max(batch.seqs[b].length for b in order)
        flat = torch.full(batch.tokens.shape, -1, dtype=torch.long, device=device)
        flat[row, column] = torch.arange(num_rows, device=device)
        table = BlockTable(cu_seqlens_q=cu, kv_start=batch.cache_base[order_t], kv_len=batch.lengths[order_t],
                           slot_mapping=slot, max_q=max(counts), max_kv=max_kv, track_rows=window[row, column])
        return cls(order_t, counts, row, column, slot, rope, flat, table)

    def prefix(self, groups: int) -> tuple[BlockTable, int]:
        """For a pass over whole sequences (counts = lengths): the block table of the first `groups` groups,
        and their number of rows."""
        t, n, longest = self.table, sum(self.counts[:groups]), max(self.counts[:groups])
        table = BlockTable(cu_seqlens_q=t.cu_seqlens_q[:groups + 1], kv_start=t.kv_start[:groups],
                           kv_len=t.kv_len[:groups], slot_mapping=t.slot_mapping[:n], max_q=longest,
                           max_kv=longest, track_rows=t.track_rows[:n])
        return table, n


def _queries(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE'd queries [..., H, D] of a layer's input hidden states x [..., d]."""
    proj, rows = block.qkv_proj, block.qkv_proj.rows(0)
    q = F.linear(block.attn_norm(x), proj.weight[rows], None if proj.bias is None else proj.bias[rows])
    return apply_rotary(q.unflatten(-1, (block.num_heads, block.head_dim)), cos, sin)


def _reuse_pass(model, batch: DecodeBatch, cache: KVCache, reuse: _Pass, tracked: torch.Tensor, drift: bool):
    """Every layer over the query rows. Returns their final hidden states [N, d], the window's attention mass
    per layer [L, B, W] (by position) and, with `drift`, the tracked rows' similarity per layer [L, B]."""
    blocks, hidden = model.transformer["blocks"], cache.hidden_states()
    tokens, lengths, base = batch.tokens, batch.lengths, batch.cache_base
    (B, width), device = tokens.shape, tokens.device
    key_mass = torch.zeros(len(blocks), B, width, device=device)
    similarity = torch.ones(len(blocks), B, device=device)
    if drift:  # the tracked rows [B, T] and every row's keys [B, W]
        t_column, t_valid = leading_columns(tracked, min(len(blocks) * batch.params.track_per_layer, width))
        t_position = (t_column - (width - lengths)[:, None]).clamp(min=0)
        t_slot, t_flat = base[:, None] + t_position, reuse.flat.gather(1, t_column).clamp(min=0)
        t_cos, t_sin = rotary_cos_sin(t_position, model.config.head_dim, model.config.rope_theta)
        offsets = torch.arange(width, device=device)
        key_valid = offsets < lengths[:, None]
        key_slot = base[:, None] + torch.where(key_valid, offsets, 0)
    x = model.transformer["wte"](tokens[reuse.row, reuse.column])
    for layer, block in enumerate(blocks):
        if drift:  # before: the cached inputs' queries against the keys as cached
            before = attention_rows(_queries(block, hidden[layer][t_slot], t_cos, t_sin), cache.k[layer][key_slot],
                                    key_valid)
            q_after = _queries(block, x[t_flat], t_cos, t_sin)
        hidden[layer][reuse.slot] = x
        x = block.forward_cached(x, reuse.rope, reuse.table, cache, key_mass[layer], model.use_kernels)
        if drift:
            after = attention_rows(q_after, cache.k[layer][key_slot], key_valid)
            similarity[layer] = drift_similarity(before, after, t_valid)
    return x, key_mass, similarity


def _refresh_pass(model, batch: DecodeBatch, cache: KVCache, first_layer: list[int], window: torch.Tensor,
                  key_mass: torch.Tensor) -> tuple[_Pass, torch.Tensor] | None:
    """Recompute layers first_layer[b]..L-1 over every position of the rows b with first_layer[b] < L, each
    from its cached input hidden states at its first layer. Overwrites their key_mass rows at those layers.
    Returns the pass and its final hidden states [N, d], or None if no row refreshes."""
    blocks, hidden = model.transformer["blocks"], cache.hidden_states()
    num_layers = len(blocks)
    order = sorted((b for b, first in enumerate(first_layer) if first < num_layers), key=first_layer.__getitem__)
    if not order:
        return None
    batch.count_query_rows([seq.length * (num_layers - first) // num_layers  # in full-depth rows
                            for seq, first in zip(batch.seqs, first_layer)])
    starts = [first_layer[b] for b in order]
    lengths = [batch.seqs[b].length for b in order]
    refresh = _Pass.build(model, batch, order, batch.attention_mask, lengths, window)
    device = refresh.row.device
    row_start = device_tensor(first_layer, device)[refresh.row]                      # [N] each row's first layer
    x = torch.zeros(refresh.row.shape[0], model.config.hidden_size, dtype=hidden[0].dtype, device=device)
    for layer in range(starts[0], num_layers):
        groups = bisect_right(starts, layer)
        table, n = refresh.prefix(groups)
        if layer in starts:  # rows joining here start from their cached inputs
            x = torch.where((row_start == layer)[:, None], hidden[layer][refresh.slot], x)
        hidden[layer][refresh.slot[:n]] = x[:n]
        mass = torch.zeros(groups, table.max_kv, device=device)
        x[:n] = blocks[layer].forward_cached(x[:n], refresh.rope[:n], table, cache, mass, model.use_kernels)
        key_mass[layer, refresh.order[:groups]] = F.pad(mass, (0, key_mass.shape[2] - table.max_kv))
    return refresh, x


def elastic_step(model, batch: DecodeBatch, cache: KVCache, mask_id: int, stop_ids: torch.Tensor | None):
    params, tokens, state = batch.params, batch.tokens, batch.position_state
    B, width = tokens.shape
    window = window_mask(tokens, batch.gen_start, params.window, mask_id, stop_ids)
    decoded = batch.attention_mask & (tokens != mask_id)  # before this step: the keys that may be tracked
    drift = any(seq.query_rows > 0 for seq in batch.seqs)  # some row is past its first pass
    counts = batch.host_query_rows
    batch.count_query_rows(counts)
    reuse = _Pass.build(model, batch, list(range(B)), state["tracked"] | state["newly"] | window, counts, window)
    x, key_mass, similarity = _reuse_pass(model, batch, cache, reuse, state["tracked"], drift)

    win_column, win_valid = leading_columns(window, min(params.window, width))
    h = x[reuse.flat.gather(1, win_column).clamp(min=0)]                            # [B, beta, d]
    if drift:
        fires = (similarity < params.drift_gamma) & (batch.steps > 0)                 # [L, B]
        first_layer = torch.where(fires.any(dim=0), fires.int().argmax(dim=0), fires.shape[0])
        refreshed = _refresh_pass(model, batch, cache, first_layer.tolist(), window, key_mass)  # 2nd host read
        if refreshed is not None:
            refresh, x_refresh = refreshed
            flat = refresh.flat.gather(1, win_column)
            h = torch.where((flat >= 0)[..., None], x_refresh[flat.clamp(min=0)], h)

    logits = model.compute_logits(model.transformer["ln_f"](h)).float()
    candidates, confidence = sample_tokens(logits, batch.temperature, batch.seed, batch.steps,
                                           win_column - batch.gen_start, sample=batch.is_sampling, mask_id=mask_id)
    transfer = transfer_threshold(confidence.masked_fill(~win_valid, float("-inf")), win_valid, batch.rule_value)
    tokens.scatter_(1, win_column, torch.where(transfer, candidates, tokens.gather(1, win_column)))

    state["newly"] = torch.zeros_like(window).scatter_(1, win_column, transfer)
    state["tracked"] = select_tracked(key_mass, decoded, batch.lengths, params.track_per_layer)
    next_window = window_mask(tokens, batch.gen_start, params.window, mask_id, stop_ids)
    batch.next_query_rows = (state["tracked"] | state["newly"] | next_window).sum(dim=1)
    batch.steps += 1
    batch.nfe += 1
