"""Scheduled flash attention over the block metadata (Triton); its reference is attention.ragged_attention_ref.

One launch for the whole batch: program (request, query tile, head) runs an online softmax in fp32 over the
request's cache range [kv_start, kv_start + kv_len), then, in a pass that does not write the cache, over the
pass's own new keys under self_visibility. With key_mass, a second sweep over the cache keys sums each key's
final softmax probability over the tile's tracked rows into one row per (query tile, head), so that no
[rows, heads, keys] tensor is ever stored; those rows are then summed in a fixed order.

With grouped-query attention (GROUP query heads per KV head) a launch packs the group (`pack_gqa`): program
(request, query tile, KV head) takes the (row, head) pairs of the KV head's GROUP query heads, flattened as
row * GROUP + g, as the rows of its tile, so that each K and V tile is read once per KV head, not GROUP times.
Everything a row decides (its position, visibility, tracking) is then that of row = m // GROUP.

Long prompts with few query rows (too few programs to fill the GPU) split each request's keys across programs:
each split writes its partial max, sum and output, a second kernel merges them in a fixed order (and gives each
row's log-sum-exp), and the key mass is then a sweep of its own over the splits.

Routed prompt keys (`RoutedKeys`: kernels/route_chunks.py's, or `routed_keys` of a mask) are visited through a
list of key tiles per (request, KV head): the tiles that hold a key it reads (every tile where a request's own
prompt rows are in the pass), so that a step reads only the open chunks of a long prompt; splits then divide
each list. Routed launches use ROUTED_BLOCK_N-key tiles: two routing chunks, not four.

An fp8 cache (kv_fp8.py: E4M3 K and V, one fp32 scale per row and KV head) is read as its tiles converted to q's
dtype (exact), each key's scale multiplying its column of scores, and each value's its column of probabilities
before P @ V: a multiply per score instead of one per K and V element (at 32 query rows x 64 keys, a quarter of a
head-dim-128 tile's). The verify pass's own keys (k_new, v_new) are in the model's dtype.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata
from .attention import ordered_sum
from .invariant_matmul import invariant_sum
from .kv_fp8 import scale_arguments

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without triton; only the kernel needs it
    triton = None


ROUTED_BLOCK_N = 64
_UNUSED: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def unused(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The argument of a pointer parameter that a constexpr flag keeps unread, one per dtype and device. Each
    parameter gets its own dtype whether it is read or not: a pointer's dtype is part of the compiled variant, so
    that the flags alone pick the variant (a stand-in of another dtype would be a variant of its own to compile,
    met first on a request's path)."""
    key = (dtype, device)
    if key not in _UNUSED:
        _UNUSED[key] = torch.zeros(1, 1, 16, dtype=dtype, device=device)  # three dims: any stride is 16 or 1
    return _UNUSED[key]


class RoutedKeys(NamedTuple):
    """The cache keys each request's KV head reads in a routed pass, and the ROUTED_BLOCK_N-key tiles that hold
    them."""
    hidden: torch.Tensor  # [B, Hkv, max_kv] bool: keys the KV head does not read
    tiles: torch.Tensor   # [B, Hkv, T] int32: the listed tiles' indices, ascending, in the first `count` entries
    count: torch.Tensor   # [B, Hkv] int32


def launch_config(max_q: int, verify: bool = False, num_seqs: int = 1, fp32: bool = False,
                  ordered: bool = False, routed: bool = False, kv_fp8: bool = False, pack: int = 1) -> dict:
    """Tile sizes by query rows per request, pass kind and batch (tuned on the H200 at LLaDA-8B shapes in bf16,
    benchmarks/tune_kernels.py). ordered: one tiling for every pass (batch-invariant decoding: a row's keys are
    then summed in the same tiles whatever the batch). kv_fp8: an fp8 cache, whose tiles are converted in
    registers: 128-key tiles, 2 stages (H200, 144 rows over 32k keys: 0.56 ms against 0.83-1.85 for the other 7
    of 8 tilings; not tuned for the verify and routed passes).

    pack: query heads per program (GROUP with pack_gqa, else 1): a tile's BLOCK_M rows are then (row, head)
    pairs, max_q * pack of them per request. Packing reads each K and V tile once per KV head instead of once per
    query head: decoding's attention (a few query rows over many keys) is bound by that read, and its small
    per-head tiles (16-32 rows) become tensor-core sized ones. Packed, up to 128 pairs share one tile (8 warps, as
    the verify pass's 128-row tiles), so that a block of 32 rows with 4 query heads per KV head reads K and V
    once (untuned: tiles of 128 pairs are a guess from the verify pass's)."""
    rows = max_q * pack
    if kv_fp8 and not (verify or routed or fp32 or ordered):
        return dict(launch_config(max_q, num_seqs=num_seqs, pack=pack), BLOCK_N=128, num_stages=2)
    if routed:
        return {**launch_config(max_q, verify, num_seqs, fp32, ordered, pack=pack), "BLOCK_N": ROUTED_BLOCK_N}
    if fp32:  # twice the bytes per tile: pipelined 128-key tiles of head dim 128 overflow the 227 KB of smem
        return {**launch_config(max_q, verify, num_seqs, ordered=ordered, pack=pack), "BLOCK_N": 64,
                "num_stages": 1}
    if ordered:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    if verify and rows > 64:  # 8 warps for its own keys and visibility mask: 0.34 against 0.54 ms at B=32, q=112
        if num_seqs >= 8:
            return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3)  # few requests: more, smaller row tiles
    if rows <= 32:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=128, num_warps=4, num_stages=3)
    if pack > 1 and rows > 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


# Enough programs to fill the H200's 132 SMs about twice; fewer, over at least SPLIT_MIN_KEYS keys, and a launch
# splits each request's keys (below that the merge costs more than the split saves: H200, 768 keys). With the
# key mass, whose split sweep reads K again, from SPLIT_MIN_KEYS_WITH_MASS (H200: 0.97-0.99x at 8k, 1.07x at 32k);
# routed, the sweep reads only the listed tiles: from SPLIT_MIN_KEYS (H200, 1/8 of 8k keys, batch 1: 2.7x).
# A split then covers at most MAX_SPLIT_KEYS keys, which shortens each program's serial loop over long prompts
# (H200, 144 rows over 32k keys with the key mass: 3 splits 0.90 ms, 6 0.72, 12 0.63).
TARGET_PROGRAMS = 264
SPLIT_MIN_KEYS, SPLIT_MIN_KEYS_WITH_MASS = 4096, 16384
MIN_SPLIT_TILES = 2  # a split covers at least this many key tiles
MAX_SPLIT_KEYS = 3072
# The merge reads every split's partials in one block: one variant for up to this many splits, not one per power
# of two (each met first on a request's path: a compile there).
MERGE_BLOCK_S = 16

# GQA packing divides the programs by the group: it pays once the packed launch still has this many (requests x KV
# heads). H100, LLaDA2-mini (16/4 heads), 32 rows over 1,024 keys: batch 1 packed 0.147 ms against 0.098 a program
# per query head (4 programs against 16); batch 32 packed 0.194 against 0.222.
PACK_MIN_PROGRAMS = 64


def packed_from(num_heads: int, num_kv_heads: int) -> int | None:
    """The fewest requests whose launch flash_attention packs by default (pack_gqa=None); None: never (MHA)."""
    return -(-PACK_MIN_PROGRAMS // num_kv_heads) if num_heads > num_kv_heads else None


def packs(num_seqs: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether flash_attention packs a launch of num_seqs requests by default (pack_gqa=None)."""
    first = packed_from(num_heads, num_kv_heads)
    return first is not None and num_seqs >= first


def num_splits(programs: int, max_kv: int, block_n: int, key_mass: bool = False) -> int:
    """Key splits per program (request, query tile, head or packed KV head): 1 when `programs` fill the GPU or
    the keys are few, else enough to fill it and to keep each under MAX_SPLIT_KEYS keys, each at least
    MIN_SPLIT_TILES key tiles long."""
    if programs >= TARGET_PROGRAMS or max_kv < (SPLIT_MIN_KEYS_WITH_MASS if key_mass else SPLIT_MIN_KEYS):
        return 1
    wanted = max(-(-TARGET_PROGRAMS // programs), -(-max_kv // MAX_SPLIT_KEYS))
    return max(1, min(wanted, max_kv // (MIN_SPLIT_TILES * block_n)))


def flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                    key_mass: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, routed: RoutedKeys | None = None,
                    splits: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, pack_gqa: bool | None = None) -> torch.Tensor:
    """q [N, H, D]; k_cache, v_cache [rows, Hkv, D] -> out [N, H, D] in q's dtype; a drop-in for
    ragged_attention_ref (same arguments, same result).

    key_mass [B, max_kv] fp32 (needs metadata.track_rows): += the softmax probability each cache key receives,
    summed over heads and tracked rows. k_new, v_new [N, Hkv, D] (with metadata.self_visibility): the rows also
    attend to the pass's own keys, and metadata.hidden_keys hides cache keys. routed (routed prompt keys): each
    KV head reads only the keys it does not hide (the others are never loaded, and only its listed key tiles are
    visited); the reference takes the mask of keys read, key_visible = ~routed.hidden. A row that sees no key
    gets 0.
    splits: key splits per program (default: `num_splits`; always 1 in the batch-invariant mode).
    k_scale, v_scale [rows, Hkv] fp32: an fp8 cache's scales (k_new, v_new stay in q's dtype).
    pack_gqa: one program per KV head whose tiles hold the rows of all its query heads (launch_config says why);
    None: packed where a KV head serves several query heads and the launch has enough requests (`packs`).
    """
    if triton is None:
        raise RuntimeError("flash_attention needs triton; use ragged_attention_ref")
    if key_mass is not None and k_new is not None:
        raise ValueError("key_mass is accumulated over cache keys only; the verify pass (k_new) tracks none")
    N, H, D = q.shape
    group = H // k_cache.shape[1]
    packed = packs(metadata.num_seqs, H, k_cache.shape[1]) if pack_gqa is None else pack_gqa
    pack = group if packed and group > 1 else 1  # query heads per program
    has_new, hidden, track = k_new is not None, metadata.hidden_keys, key_mass is not None
    if N == 0:
        return torch.empty_like(q)
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    fp8 = scale_arguments(k_cache, v_cache, k_scale, v_scale)
    config = launch_config(metadata.max_q, verify=has_new, num_seqs=metadata.num_seqs,
                           fp32=q.dtype == torch.float32, ordered=metadata.ordered, routed=routed is not None,
                           kv_fp8=fp8.on, pack=pack)
    tiles = triton.cdiv(metadata.max_q * pack, config["BLOCK_M"])
    programs = tiles * (H // pack)  # per request and split: (query tile, head) or packed (query tile, KV head)
    if splits is None:  # the batch-invariant mode never splits: the split count depends on the batch
        splits = 1 if metadata.ordered else num_splits(metadata.num_seqs * programs, metadata.max_kv,
                                                        config["BLOCK_N"], track and routed is None)
    kv_chunk = triton.cdiv(triton.cdiv(max(metadata.max_kv, 1), splits), config["BLOCK_N"]) * config["BLOCK_N"]
    grid = (metadata.num_seqs, tiles, (H // pack) * splits)
    # A verify pass may end in padding rows that belong to no request (cuda_graphs.pad_verify_pass): no
    # program visits them, so they must start at 0 (and so must the rows of a split launch's partials).
    out = torch.zeros_like(q) if has_new else torch.empty_like(q)
    split = splits > 1
    if split:  # each split's unnormalised output, running max and sum
        part_out = torch.zeros(splits, N, H, D, dtype=torch.float32, device=q.device)
        part_max = torch.full((splits, N, H), float("-inf"), device=q.device)
        part_sum = torch.zeros(splits, N, H, device=q.device)
    else:
        part_out = out
        part_max = part_sum = unused(torch.float32, q.device)
    # The disabled features' pointers: typed stand-ins (`unused`), kept unread by their constexpr flags.
    k_new, v_new = (k_new, v_new) if has_new else (k_cache, v_cache)
    u8 = unused(torch.uint8, q.device)
    visibility = metadata.self_visibility.contiguous().view(torch.uint8) if has_new else u8
    listed = listed_count = unused(torch.int32, q.device)
    if routed is not None:  # one mask per KV head
        listed, listed_count = routed.tiles, routed.count
        hidden = routed.hidden if hidden is None else routed.hidden | hidden[:, None, :]
    has_hidden, has_tiles = hidden is not None, routed is not None
    hidden = hidden.contiguous().view(torch.uint8) if has_hidden else u8
    stride_hh = hidden.stride(1) if has_tiles else 0
    stride_tb, stride_th = (listed.stride(0), listed.stride(1)) if has_tiles else (0, 0)
    track_rows = metadata.track_rows.contiguous().view(torch.uint8) if track else u8
    # Atomics would add the partial masses in a different order every run, and a near-tie in the tracked
    # set could then flip a token; partial rows summed after the launch give the same mass every time.
    partial = (torch.zeros(metadata.num_seqs, programs, metadata.max_kv, device=q.device) if track
               else unused(torch.float32, q.device))
    dot_fp32 = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    block_d = max(16, triton.next_power_of_2(D))
    _flash_attention_kernel[grid](
        q, k_cache, v_cache, *fp8.pointers, part_out, part_max, part_sum, k_new, v_new,
        metadata.cu_seqlens_q, metadata.kv_start, metadata.kv_len, hidden, visibility, track_rows, partial,
        listed, listed_count, stride_tb, stride_th, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        *fp8.strides, part_out.stride(-3), part_out.stride(-2), part_out.stride(0) if split else 0,
        part_max.stride(0) if split else 0, H, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        hidden.stride(0), stride_hh, visibility.stride(0), visibility.stride(1), partial.stride(0),
        partial.stride(1), D ** -0.5, D, kv_chunk, H,
        GROUP=group, PACK=pack, HAS_HIDDEN=has_hidden, HAS_NEW=has_new, TRACK=track and not split,
        SPLIT=split, HAS_TILES=has_tiles, KV_FP8=fp8.on, BLOCK_D=block_d, DOT_FP32=dot_fp32, **config)
    if split:
        lse = torch.empty(N, H, device=q.device) if track else unused(torch.float32, q.device)
        _merge_splits_kernel[(N, H)](
            part_out, part_max, part_sum, out, lse, splits, part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_max.stride(0), part_max.stride(1), out.stride(0), out.stride(1), D,
            KEEP_LSE=track, BLOCK_S=max(MERGE_BLOCK_S, triton.next_power_of_2(splits)), BLOCK_D=block_d)
        if track:
            _key_mass_kernel[grid](
                q, k_cache, fp8.pointers[0], lse, partial, metadata.cu_seqlens_q, metadata.kv_start, metadata.kv_len,
                hidden, track_rows, listed, listed_count, stride_tb, stride_th, q.stride(0), q.stride(1),
                k_cache.stride(0), k_cache.stride(1), fp8.strides[0], lse.stride(0), hidden.stride(0), stride_hh,
                partial.stride(0), partial.stride(1), D ** -0.5, D, kv_chunk, H, GROUP=group, PACK=pack,
                HAS_HIDDEN=has_hidden, HAS_TILES=has_tiles, KV_FP8=fp8.on,
                BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d, DOT_FP32=dot_fp32,
                num_warps=config["num_warps"], num_stages=config["num_stages"])
    if track and not metadata.ordered:
        key_mass += partial.sum(dim=1)
    elif track:  # in one order (the other requests' extra query tiles add zeros after this one's): on the GPU a
        # dot against ones (a cumsum took 18 us a layer on the H200), interpreted on the CPU a scan (the dot: 0.3 s)
        key_mass += invariant_sum(partial.transpose(1, 2)) if q.is_cuda else ordered_sum(partial, dim=1)
    return out


def routed_keys(key_visible: torch.Tensor, kv_len: torch.Tensor) -> RoutedKeys:
    """key_visible [B, Hkv, max_kv] bool, kv_len [B] -> the RoutedKeys that read those keys: per request and KV
    head, the key tiles of its range that hold a visible key (PyTorch; kernels/route_chunks.py builds them in its
    launch)."""
    B, Hkv, K = key_visible.shape
    T = -(-max(K, 1) // ROUTED_BLOCK_N)
    listed = F.pad(key_visible, (0, T * ROUTED_BLOCK_N - K)).view(B, Hkv, T, ROUTED_BLOCK_N).any(dim=-1)
    in_range = (torch.arange(T, device=key_visible.device) * ROUTED_BLOCK_N < kv_len[:, None])[:, None, :]
    listed = listed & in_range
    index = torch.arange(T, device=key_visible.device, dtype=torch.int32)
    tiles = torch.where(listed, index, index + T).sort(dim=-1).values                # listed first, in order
    return RoutedKeys(~key_visible, tiles, listed.sum(dim=-1, dtype=torch.int32))


if triton is not None:
    @triton.jit
    def _dot(a, b, DOT_FP32: tl.constexpr):
        if DOT_FP32:  # exact fp32 products; also the interpreter's path, whose 16-bit tl.dot is wrong
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _softmax_step(b_s, b_v, b_vs, b_m, b_l, b_acc, V_SCALED: tl.constexpr, DOT_FP32: tl.constexpr):
        """Fold one tile of log2-domain scores b_s [M, N] (-inf where hidden) and values b_v [N, D] into the
        running max b_m, sum b_l and output b_acc. A row with nothing visible so far keeps weight 0, not NaN.
        V_SCALED: the values are b_v * b_vs[:, None] (an fp8 cache's, b_vs [N] their scales)."""
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.exp2(b_s - b_m_safe[:, None])
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if V_SCALED:
            b_p = b_p * b_vs[None, :]
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, DOT_FP32)
        return b_m_new, b_l, b_acc

    @triton.jit
    def _key_range(seq, kv_head, num_kv_heads, split, kv_len, kv_chunk, tiles_ptr, count_ptr, stride_tb, stride_th,
                   HAS_TILES: tl.constexpr, BLOCK_N: tl.constexpr):
        """The loop bounds (first, end, step) of this split's cache keys, and its tile list's address: with
        HAS_TILES the loop runs over entries of the list, the split taking its share of this list's tiles;
        else over key offsets, the split taking kv_chunk keys."""
        kv_len = kv_len.to(tl.int32)
        if HAS_TILES:
            p_tiles = tiles_ptr + seq * stride_tb + kv_head * stride_th
            count = tl.load(count_ptr + seq * num_kv_heads + kv_head)
            share = tl.cdiv(count, tl.cdiv(tl.maximum(kv_len, 1), kv_chunk))  # the same split count as the keys'
            first, end, step = split * share, tl.minimum(count, split * share + share), 1
        else:
            p_tiles = tiles_ptr
            first, end, step = split * kv_chunk, tl.minimum(kv_len, split * kv_chunk + kv_chunk), BLOCK_N
        return first, end, step, p_tiles

    @triton.jit
    def _query_entries(cu_q_ptr, seq, tile, head_program, PACK: tl.constexpr, BLOCK_M: tl.constexpr):
        """The request's first row and row count, and for each of the tile's BLOCK_M entries its query row and
        query head: the (row, head) pairs of heads head_program * PACK.. (PACK of them), flattened as
        row * PACK + g, from pair tile * BLOCK_M on (PACK 1: one head's rows)."""
        q_begin = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
        o_pair = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        return q_begin, q_len, o_pair // PACK, head_program * PACK + o_pair % PACK

    @triton.jit
    def _tile_start(i, p_tiles, HAS_TILES: tl.constexpr, BLOCK_N: tl.constexpr):
        """The first key offset of loop entry i: a listed tile's, or i itself (a key offset)."""
        start = i
        if HAS_TILES:
            start = tl.load(p_tiles + i) * BLOCK_N
        return start

    @triton.jit
    def _cache_scores(b_q, k_ptr, ks_ptr, hidden_ptr, seq, kv_begin, kv_len, start, kv_head, stride_kn, stride_kh,
                      stride_ksn, stride_hb, stride_hh, qk_scale, o_d, m_d, HAS_HIDDEN: tl.constexpr,
                      KV_FP8: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        """Log2-domain scores [M, BLOCK_N] of the cache keys start.. of the request (-inf where out of range
        or hidden) and the mask of the keys loaded."""
        o_n = start + tl.arange(0, BLOCK_N)
        m_key = o_n < kv_len
        if HAS_HIDDEN:
            b_hidden = tl.load(hidden_ptr + seq * stride_hb + kv_head * stride_hh + o_n, mask=m_key, other=1)
            m_key = m_key & (b_hidden == 0)
        b_k = tl.load(k_ptr + (kv_begin + o_n)[:, None] * stride_kn + kv_head * stride_kh + o_d[None, :],
                      mask=m_key[:, None] & m_d[None, :], other=0.0)
        if KV_FP8:  # E4M3 keys, exact in q's dtype; each key's scale on its column of scores
            b_ks = tl.load(ks_ptr + (kv_begin + o_n) * stride_ksn + kv_head, mask=m_key, other=0.0)
            b_s = _dot(b_q, tl.trans(b_k.to(b_q.dtype)), DOT_FP32) * (b_ks * qk_scale)[None, :]
        else:
            b_s = _dot(b_q, tl.trans(b_k), DOT_FP32) * qk_scale
        return tl.where(m_key[None, :], b_s, float("-inf")), m_key

    # Strides that vary with the step's shapes are not specialised on (divisibility by 16): each new
    # combination would compile a new kernel in the middle of decoding.
    @triton.jit(do_not_specialize=["stride_hb", "stride_hh", "stride_visb", "stride_visq", "stride_mb", "stride_mr",
                                   "stride_os", "stride_ms", "kv_chunk", "stride_tb", "stride_th"])
    def _flash_attention_kernel(
            q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, m_ptr, l_ptr, kn_ptr, vn_ptr,
            cu_q_ptr, kv_start_ptr, kv_len_ptr, hidden_ptr, vis_ptr, track_ptr, mass_ptr,
            tiles_ptr, count_ptr, stride_tb, stride_th, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
            stride_vh, stride_ksn, stride_vsn, stride_on, stride_oh, stride_os,
            stride_ms, stride_mn, stride_knn, stride_knh, stride_vnn, stride_vnh, stride_hb, stride_hh, stride_visb,
            stride_visq, stride_mb, stride_mr, scale, D, kv_chunk, H,
            GROUP: tl.constexpr, PACK: tl.constexpr, HAS_HIDDEN: tl.constexpr, HAS_NEW: tl.constexpr,
            TRACK: tl.constexpr, SPLIT: tl.constexpr, HAS_TILES: tl.constexpr, KV_FP8: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
        """Program (request, query tile, head program, split): the head program's PACK query heads (one, or a
        KV head's GROUP) over one KV head's keys."""
        seq, tile, programs = tl.program_id(0), tl.program_id(1), H // PACK
        head_program, split = tl.program_id(2) % programs, tl.program_id(2) // programs
        q_begin, q_len, o_m, o_h = _query_entries(cu_q_ptr, seq, tile, head_program, PACK, BLOCK_M)  # row, head
        if tile * BLOCK_M >= q_len * PACK:
            return
        kv_begin, kv_len = tl.load(kv_start_ptr + seq), tl.load(kv_len_ptr + seq)
        kv_head = head_program * PACK // GROUP
        kv_first, kv_end, step, p_tiles = _key_range(seq, kv_head, H // GROUP, split, kv_len, kv_chunk, tiles_ptr,
                                                     count_ptr, stride_tb, stride_th, HAS_TILES, BLOCK_N)
        o_d = tl.arange(0, BLOCK_D)
        m_m, m_d = o_m < q_len, o_d < D
        b_q = tl.load(q_ptr + ((q_begin + o_m) * stride_qn + o_h * stride_qh)[:, None] + o_d[None, :],
                      mask=m_m[:, None] & m_d[None, :], other=0.0)
        qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))

        b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for i in range(kv_first, kv_end, step):
            start = _tile_start(i, p_tiles, HAS_TILES, BLOCK_N)
            b_s, m_key = _cache_scores(b_q, k_ptr, ks_ptr, hidden_ptr, seq, kv_begin, kv_len, start, kv_head,
                                       stride_kn, stride_kh, stride_ksn, stride_hb, stride_hh, qk_scale, o_d, m_d,
                                       HAS_HIDDEN, KV_FP8, BLOCK_N, DOT_FP32)
            o_row = kv_begin + start + tl.arange(0, BLOCK_N)
            b_v = tl.load(v_ptr + o_row[:, None] * stride_vn + kv_head * stride_vh + o_d[None, :],
                          mask=m_key[:, None] & m_d[None, :], other=0.0)
            b_vs = b_l  # unread without KV_FP8
            if KV_FP8:  # E4M3 values, exact in q's dtype; their scales on the probabilities
                b_v = b_v.to(b_q.dtype)
                b_vs = tl.load(vs_ptr + o_row * stride_vsn + kv_head, mask=m_key, other=0.0)
            b_m, b_l, b_acc = _softmax_step(b_s, b_v, b_vs, b_m, b_l, b_acc, KV_FP8, DOT_FP32)
        if HAS_NEW:  # the pass's own keys (split 0): rows q_begin.., visible as self_visibility[seq, row, key] says
            for start in range(0, tl.where(split == 0, q_len, 0), BLOCK_N):
                o_n = start + tl.arange(0, BLOCK_N)
                m_n = o_n < q_len
                m_kd = m_n[:, None] & m_d[None, :]
                b_k = tl.load(kn_ptr + (q_begin + o_n)[:, None] * stride_knn + kv_head * stride_knh + o_d[None, :],
                              mask=m_kd, other=0.0)
                b_v = tl.load(vn_ptr + (q_begin + o_n)[:, None] * stride_vnn + kv_head * stride_vnh + o_d[None, :],
                              mask=m_kd, other=0.0)
                b_vis = tl.load(vis_ptr + seq * stride_visb + o_m[:, None] * stride_visq + o_n[None, :],
                                mask=m_m[:, None] & m_n[None, :], other=0)
                b_s = _dot(b_q, tl.trans(b_k), DOT_FP32) * qk_scale
                b_s = tl.where(b_vis != 0, b_s, float("-inf"))
                b_m, b_l, b_acc = _softmax_step(b_s, b_v, b_l, b_m, b_l, b_acc, False, DOT_FP32)

        p_out = o_ptr + ((q_begin + o_m) * stride_on + o_h * stride_oh)[:, None] + o_d[None, :]
        if SPLIT:  # this split's unnormalised output, max and sum, merged by _merge_splits_kernel
            p_row = split * stride_ms + (q_begin + o_m) * stride_mn + o_h
            tl.store(p_out + split * stride_os, b_acc, mask=m_m[:, None] & m_d[None, :])
            tl.store(m_ptr + p_row, b_m, mask=m_m)
            tl.store(l_ptr + p_row, b_l, mask=m_m)
        else:
            b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]  # a row that saw no key has b_acc = 0
            tl.store(p_out, b_o.to(o_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])

        if TRACK:  # second sweep: each cache key's final probability, summed over this tile's tracked rows
            b_track = (tl.load(track_ptr + q_begin + o_m, mask=m_m, other=0) != 0) & (b_l > 0)
            b_lse = b_m + tl.log2(tl.where(b_track, b_l, 1.0))
            # A tile without tracked rows (decoded positions only) skips the sweep; its partial row stays 0.
            sweep_end = tl.where(tl.sum(b_track.to(tl.int32), 0) > 0, kv_end, kv_first)
            for i in range(kv_first, sweep_end, step):
                start = _tile_start(i, p_tiles, HAS_TILES, BLOCK_N)
                b_s, m_key = _cache_scores(b_q, k_ptr, ks_ptr, hidden_ptr, seq, kv_begin, kv_len, start, kv_head,
                                           stride_kn, stride_kh, stride_ksn, stride_hb, stride_hh, qk_scale, o_d,
                                           m_d, HAS_HIDDEN, KV_FP8, BLOCK_N, DOT_FP32)
                b_p = tl.where(b_track[:, None], tl.exp2(b_s - b_lse[:, None]), 0.0)
                o_n = start + tl.arange(0, BLOCK_N)
                p_mass = mass_ptr + seq * stride_mb + (tile * programs + head_program) * stride_mr + o_n
                tl.store(p_mass, tl.sum(b_p, 0), mask=m_key)

    @triton.jit(do_not_specialize=["S", "stride_os", "stride_ms"])
    def _merge_splits_kernel(part_ptr, m_ptr, l_ptr, o_ptr, lse_ptr, S, stride_os, stride_on, stride_oh,
                             stride_ms, stride_mn, stride_qn, stride_qh, D, KEEP_LSE: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """Row (program 0) and head (program 1) of a split launch: out = sum_s 2^(m_s - m) acc_s / l, with
        l = sum_s 2^(m_s - m) l_s and m the largest m_s, summed over the splits in one order; and the row's
        log2-domain log-sum-exp m + log2 l (-inf where it saw no key)."""
        row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        o_s, o_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
        m_s, m_d = o_s < S, o_d < D
        p_stat = o_s * stride_ms + row * stride_mn + head
        b_m = tl.load(m_ptr + p_stat, mask=m_s, other=float("-inf"))
        b_l = tl.load(l_ptr + p_stat, mask=m_s, other=0.0)
        b_max = tl.max(b_m, 0)
        b_w = tl.exp2(b_m - tl.where(b_max == float("-inf"), 0.0, b_max))  # 0 for a split that saw no key
        b_sum = tl.sum(b_w * b_l, 0)
        b_acc = tl.load(part_ptr + o_s[:, None] * stride_os + row * stride_on + head * stride_oh + o_d[None, :],
                        mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_o = tl.sum(b_w[:, None] * b_acc, 0) / tl.where(b_sum > 0, b_sum, 1.0)
        tl.store(o_ptr + row * stride_qn + head * stride_qh + o_d, b_o.to(o_ptr.dtype.element_ty), mask=m_d)
        if KEEP_LSE:
            tl.store(lse_ptr + row * stride_mn + head,
                     tl.where(b_sum > 0, b_max + tl.log2(tl.where(b_sum > 0, b_sum, 1.0)), float("-inf")))

    @triton.jit(do_not_specialize=["stride_hb", "stride_hh", "stride_mb", "stride_mr", "kv_chunk", "stride_tb",
                                   "stride_th"])
    def _key_mass_kernel(
            q_ptr, k_ptr, ks_ptr, lse_ptr, mass_ptr, cu_q_ptr, kv_start_ptr, kv_len_ptr, hidden_ptr, track_ptr,
            tiles_ptr, count_ptr, stride_tb, stride_th, stride_qn, stride_qh, stride_kn, stride_kh, stride_ksn,
            stride_lse, stride_hb, stride_hh, stride_mb, stride_mr,
            scale, D, kv_chunk, H,
            GROUP: tl.constexpr, PACK: tl.constexpr, HAS_HIDDEN: tl.constexpr, HAS_TILES: tl.constexpr,
            KV_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            DOT_FP32: tl.constexpr):
        """Each cache key's final probability (from the rows' log-sum-exp) summed over the tile's tracked rows,
        into row (tile, head program) of the request's partial masses, over this program's split of the keys;
        the programs are _flash_attention_kernel's."""
        seq, tile, programs = tl.program_id(0), tl.program_id(1), H // PACK
        head_program, split = tl.program_id(2) % programs, tl.program_id(2) // programs
        q_begin, q_len, o_m, o_h = _query_entries(cu_q_ptr, seq, tile, head_program, PACK, BLOCK_M)  # row, head
        if tile * BLOCK_M >= q_len * PACK:
            return
        kv_begin, kv_len = tl.load(kv_start_ptr + seq), tl.load(kv_len_ptr + seq)
        kv_head = head_program * PACK // GROUP
        kv_first, kv_end, step, p_tiles = _key_range(seq, kv_head, H // GROUP, split, kv_len, kv_chunk,
                                                     tiles_ptr, count_ptr, stride_tb, stride_th, HAS_TILES, BLOCK_N)
        o_d = tl.arange(0, BLOCK_D)
        m_m, m_d = o_m < q_len, o_d < D
        b_lse = tl.load(lse_ptr + (q_begin + o_m) * stride_lse + o_h, mask=m_m, other=float("-inf"))
        b_track = (tl.load(track_ptr + q_begin + o_m, mask=m_m, other=0) != 0) & (b_lse > float("-inf"))
        # A tile without tracked rows (decoded positions only) skips the sweep; its partial row stays 0.
        kv_end = tl.where(tl.sum(b_track.to(tl.int32), 0) > 0, kv_end, kv_first)
        b_q = tl.load(q_ptr + ((q_begin + o_m) * stride_qn + o_h * stride_qh)[:, None] + o_d[None, :],
                      mask=m_m[:, None] & m_d[None, :], other=0.0)
        b_lse = tl.where(b_track, b_lse, 0.0)
        qk_scale = scale * 1.4426950408889634
        for i in range(kv_first, kv_end, step):
            start = _tile_start(i, p_tiles, HAS_TILES, BLOCK_N)
            b_s, m_key = _cache_scores(b_q, k_ptr, ks_ptr, hidden_ptr, seq, kv_begin, kv_len, start, kv_head,
                                       stride_kn, stride_kh, stride_ksn, stride_hb, stride_hh, qk_scale, o_d, m_d,
                                       HAS_HIDDEN, KV_FP8, BLOCK_N, DOT_FP32)
            b_p = tl.where(b_track[:, None], tl.exp2(b_s - b_lse[:, None]), 0.0)
            o_n = start + tl.arange(0, BLOCK_N)
            p_mass = mass_ptr + seq * stride_mb + (tile * programs + head_program) * stride_mr + o_n
            tl.store(p_mass, tl.sum(b_p, 0), mask=m_key)
