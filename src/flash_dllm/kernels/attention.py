"""Scheduled attention over the attention metadata, PyTorch reference; and attention whose sums over keys run in
one fixed order (batch-invariant decoding).

Each request's query rows attend to its range of the flat KV cache. The reference takes one request at a time,
its rows against its own keys (no padding to the batch's longest), and holds no [rows, keys] tensor larger than
REFERENCE_BLOCK_BYTES: the output comes from PyTorch's attention (which never materialises the scores), and the
key mass from the tracked rows alone, in chunks of rows. The Triton kernel (flash_attention.py) replaces it on
the GPU and is tested against it.

PyTorch's attention, softmax and matmuls group a sum over keys by its length: padding keys (exact zeros after
the softmax) still change how the real ones are grouped, so a request's result depends on the longest request
of its batch. `ordered_attention` sums keys in chunks of ORDER_CHUNK by matmul (a fixed length), then the
chunks' partial sums left to right: a row's result depends only on its visible keys and their positions from
index 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata
from .kv_fp8 import dequantize_kv


ORDER_CHUNK = 64


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` added left to right, one element at a time (a scan): zeros that follow the values,
    however many, leave it unchanged."""
    return x.cumsum(dim).select(dim, -1)


# The most bytes of fp32 scores [..., rows, keys] that the PyTorch paths hold at once: an 8,000-token prompt's first
# pass as one [6 heads, 8000, 8000] tensor is 1.5 GB, and the key-mass path held several (max RSS 6.4 GB for one
# prompt of the embedded model on the CPU, 11.2 for two).
REFERENCE_BLOCK_BYTES = 64 << 20


def rows_per_block(scores_per_row: int, block_bytes: int = REFERENCE_BLOCK_BYTES) -> int:
    """How many query rows of scores_per_row fp32 scores each (heads x keys, times the batch) fit block_bytes (at
    least one)."""
    return max(1, block_bytes // (4 * max(1, scores_per_row)))


def ordered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, Q or K, D]; v [B, H, K, Dv]; visible [B, 1 or H, 1 or Q, K] -> (out [B, H, Q, Dv] in q's dtype,
    probabilities [B, H, Q, K] fp32), every sum over keys in one order (module docstring). A row that sees no
    key gets zeros."""
    return _ordered_rows(q, *_ordered_keys(k, v), visible)


def ordered_attention_in_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                                block_bytes: int = REFERENCE_BLOCK_BYTES) -> torch.Tensor:
    """ordered_attention's out, its query rows in chunks whose scores fit block_bytes (a row's sums do not depend on
    the other rows of its chunk, as long as the CPU's GEMMs give a row the same result for any row count)."""
    B, H, Q, _ = q.shape
    keys, values = _ordered_keys(k, v)
    chunks = -(-Q // rows_per_block(B * H * keys.shape[2], block_bytes))
    if chunks == 1:
        return _ordered_rows(q, keys, values, visible)[0]
    rows = -(-Q // chunks)  # equal chunks: no short last one (CPU GEMMs of 1-3 rows round differently)
    out = q.new_empty(B, H, Q, v.shape[-1])
    for start in range(0, Q, rows):
        part = visible if visible.shape[2] == 1 else visible[:, :, start:start + rows]
        out[:, :, start:start + rows] = _ordered_rows(q[:, :, start:start + rows], keys, values, part)[0]
    return out


def _ordered_keys(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, H, K, D], v [B, H, K, Dv] -> fp32 keys padded to whole chunks of ORDER_CHUNK [B, H, Kp, D], and the values
    padded alike with a column of ones (its sum is the softmax's denominator) [B, H, Kp, Dv + 1]."""
    B, H, K, _ = k.shape
    pad_keys = lambda t: F.pad(t.float(), (0, 0, 0, -(-K // ORDER_CHUNK) * ORDER_CHUNK - K))
    values = pad_keys(v)
    return pad_keys(k), torch.cat([values, values.new_ones(B, H, values.shape[2], 1)], dim=-1)


def _ordered_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ordered_attention over _ordered_keys' keys and values; visible [B, 1 or H, 1 or Q, K <= Kp]."""
    (B, H, Q, D), (padded, K) = q.shape, (keys.shape[2], visible.shape[-1])
    scores = (q.float() @ keys.transpose(-1, -2)) * D ** -0.5                        # sums over D only
    visible = F.pad(visible, (0, padded - K)).expand(B, H, Q, padded)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))        # 0 where not visible
    chunks, Dv = padded // ORDER_CHUNK, values.shape[-1] - 1
    partial = weights.view(B, H, Q, chunks, ORDER_CHUNK).transpose(2, 3) @ values.view(B, H, chunks, ORDER_CHUNK,
                                                                                        Dv + 1)
    total = ordered_sum(partial, dim=2)                                                 # [B, H, Q, Dv + 1]
    normaliser = total[..., Dv:].masked_fill(total[..., Dv:] == 0, 1.0)
    out = (total[..., :Dv] / normaliser).to(q.dtype)
    return out, (weights / normaliser)[..., :K]


def ragged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                         key_mass: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                         v_new: torch.Tensor | None = None, key_visible: torch.Tensor | None = None,
                         block_bytes: int = REFERENCE_BLOCK_BYTES, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D]; k_cache, v_cache [rows, Hkv, D] -> out [N, H, D] in q's dtype.

    With key_mass [B, >= max_kv] (fp32), adds for every cache key the softmax probability it receives, summed over
    heads and over the query rows marked in metadata.track_rows. With k_new, v_new [N, Hkv, D] (a pass that
    does not write the cache), the rows also attend to these keys under metadata.self_visibility. With
    key_visible [B, Hkv, max_kv] bool (routed prompt keys), each KV head's rows read only the keys it marks.
    block_bytes: the most bytes of fp32 scores held at once (the ordered attention's and the key mass's).
    k_scale, v_scale [rows, Hkv] fp32: an fp8 cache, each request's range dequantised to q's dtype when it is read
    (k_new, v_new stay in q's dtype).

    The requests' row ranges, cache ranges and tracked counts are read to the host once a call (the Triton
    kernel, the GPU's path, reads nothing back).
    """
    group = q.shape[1] // k_cache.shape[1]
    cu = metadata.cu_seqlens_q
    shapes = [cu[:-1], cu[1:], metadata.kv_start, metadata.kv_len]
    if key_mass is not None:
        tracked_before = F.pad(metadata.track_rows.long().cumsum(0), (1, 0))              # [N + 1]
        shapes.append(tracked_before[cu[1:]] - tracked_before[cu[:-1]])
    if metadata.ordered:
        assert key_visible is None, "routed keys are not summed in the batch-invariant order"
    out = torch.zeros_like(q)  # a row that sees no key gets zeros, as in the kernel
    for b, (first, end, kv_start, kv_len, *num_tracked) in enumerate(zip(*torch.stack(shapes).tolist())):
        keys, values = k_cache[kv_start:kv_start + kv_len], v_cache[kv_start:kv_start + kv_len]
        if k_scale is not None:
            keys = dequantize_kv(keys, k_scale[kv_start:kv_start + kv_len], q.dtype)
            values = dequantize_kv(values, v_scale[kv_start:kv_start + kv_len], q.dtype)
        if k_new is not None:  # the pass's own rows, right after its cache range
            keys, values = torch.cat([keys, k_new[first:end]]), torch.cat([values, v_new[first:end]])
        if first == end or keys.shape[0] == 0:
            continue
        visible = _visible_keys(metadata, b, kv_len, end - first, key_visible, group)    # [1 or H, 1 or Q, K]
        qb, kb, vb = (t.transpose(0, 1) for t in (q[first:end], keys, values))           # [H or Hkv, rows, D]
        heads = lambda t: t if group == 1 else t.repeat_interleave(group, dim=0)           # one per query head
        if metadata.ordered:
            if visible is None:
                visible = torch.ones(1, 1, keys.shape[0], dtype=torch.bool, device=q.device)
            attended = ordered_attention_in_chunks(qb[None], heads(kb)[None], heads(vb)[None], visible[None],
                                                   block_bytes)[0]
        else:
            # 4-D: on the CPU, PyTorch's flash kernel (3-D inputs take the math path, which holds the scores)
            attended = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], enable_gqa=group > 1,
                                                      attn_mask=None if visible is None else visible[None])[0]
        out[first:end] = attended.transpose(0, 1)
        if key_mass is not None and num_tracked[0] > 0:
            tracked = torch.argsort(~metadata.track_rows[first:end], stable=True)[:num_tracked[0]]  # in row order
            if visible is not None and visible.shape[1] > 1:
                visible = visible[:, tracked]
            key_mass[b, :kv_len] += _tracked_mass(qb[:, tracked], heads(kb), visible, kv_len, metadata.ordered,
                                                  block_bytes)
    return out


def _visible_keys(metadata: AttentionMetadata, b: int, kv_len: int, num_rows: int, key_visible: torch.Tensor | None,
                  group: int) -> torch.Tensor | None:
    """Request b's visibility of its keys [1 or H, 1 or Q, K] (its cache range, then its own rows in a verify pass),
    or None where it sees every key."""
    visible = None
    if metadata.hidden_keys is not None:
        visible = ~metadata.hidden_keys[b, :kv_len][None, None]
    if key_visible is not None:
        routed = key_visible[b, :, :kv_len].repeat_interleave(group, dim=0)[:, None]        # [H, 1, K]
        visible = routed if visible is None else visible & routed
    if metadata.self_visibility is not None:
        cache_part = torch.ones(1, 1, kv_len, dtype=torch.bool, device=metadata.kv_len.device) if visible is None \
            else visible
        own = metadata.self_visibility[b, :num_rows, :num_rows][None]
        visible = torch.cat([cache_part.expand(-1, num_rows, -1), own.expand(cache_part.shape[0], -1, -1)], dim=2)
    return visible


def _tracked_mass(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None, kv_len: int, ordered: bool,
                  block_bytes: int) -> torch.Tensor:
    """q [H, T, D] (the tracked rows), keys [H, K, D], visible [1 or H, 1 or T, K] or None (every key) -> [kv_len]
    fp32: the softmax probability each of the first kv_len keys receives, summed over heads and rows, the rows in
    chunks. ordered: added one at a time, the running sum first, then each chunk's heads and rows in order."""
    H, T, D = q.shape
    rows = rows_per_block(H * keys.shape[1], block_bytes)
    if ordered:
        ordered_keys = _ordered_keys(keys[None], keys[None, ..., :1])  # its values are unused
        if visible is None:
            visible = torch.ones(1, 1, keys.shape[1], dtype=torch.bool, device=q.device)
    keys = keys.float()
    mass = keys.new_zeros(1, kv_len)
    for start in range(0, T, rows):
        part = visible if visible is None or visible.shape[1] == 1 else visible[:, start:start + rows]
        if ordered:
            probs = _ordered_rows(q[None, :, start:start + rows], *ordered_keys, part[None])[1][0]
            mass = ordered_sum(torch.cat([mass, probs[..., :kv_len].flatten(0, 1)]), dim=0)[None]
        else:
            scores = (q[:, start:start + rows].float() @ keys.transpose(-1, -2)).mul_(D ** -0.5)
            if part is None:
                probs = scores.softmax(dim=-1)
            else:  # a row that sees no key has probability 0 everywhere, not NaN, as in the kernel
                probs = scores.masked_fill_(~part, float("-inf")).softmax(dim=-1).nan_to_num_(0.0)
            mass[0] += probs[..., :kv_len].sum(dim=(0, 1))
    return mass[0]
