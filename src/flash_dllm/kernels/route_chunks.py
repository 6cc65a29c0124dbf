"""A routed pass's keys per layer in two or three launches (Triton), beside the reference
(cache/routing.route_stored, whose mask `flash_attention.routed_keys` lists).

The reference's routing costs ~25 PyTorch launches a layer (fp32 score GEMMs, a sort, gathers, scatters, the
tile list), more than the attention saves by reading 1/8 of a prompt (H200, 8k prompt, batch 1). Here:
- `_chunk_scores_kernel`, program (request, KV head, block of chunks): each chunk's score from the summaries kept
  beside the cache, the largest over the pass's scoring rows and the KV head's query heads: the upper bound
  sum_d max(q_d lo_d, q_d hi_d) (`chunk`), or q . mean (`centroid`, the bound of lo = hi = mean); requests of
  other policies, dense or not pure return at once. A second launch scores the k-means regions by their bounds
  (`kmeans`: KVCache.kmeans_regions, laid out as the chunk summaries), where the pass has kmeans requests.
- `_open_chunks_kernel`, program (request, KV head): the regions opened, the longest run of the ranking (best
  score first, equal scores in region order; `window`: by position, `random`: by the reference's hash) within
  the budget: top_k chunks, or top_k * CHUNK keys of k-means regions of any size, found by bisection on the
  scores' order-preserving integer bits; then, block of keys by block, the hidden keys (a k-means key's region
  read from the row its layout put it in), the list of key tiles that hold a key read, and the prompt keys read
  and dense (atomic adds of integers: exact in any order).
No host syncs: graph capturable.
"""
from __future__ import annotations

import os

import torch

from ..cache.routing import CHUNK, POLICIES, RANDOM_HASH, SINKS, WINDOW, route_stored
from .flash_attention import ROUTED_BLOCK_N, RoutedKeys, routed_keys

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None

SCORE_CHUNKS = 32   # chunks per scoring program (batch 1, 8k prompt: 64 programs)
# chunks per block of the open-chunks program's writes (H200, 8k, batch 1: 13.8 us a layer with 4 warps; 20.3 with
# one warp and 32 chunks)
WRITE_CHUNKS = 64


def route_chunks_ref(q: torch.Tensor, summaries: torch.Tensor, metadata, layer: int,
                     kmeans: tuple[torch.Tensor, ...] | None = None) -> RoutedKeys:
    """q [N, H, D] the pass's rotated queries; summaries [cache rows / CHUNK, 3, Hkv, D] (the layer's
    KVCache.chunk_summaries) -> the keys each request's KV head reads; adds the prompt keys read and dense to
    metadata.routing's counters. kmeans: the layer's k-means regions, where the pass has kmeans requests."""
    return routed_keys(route_stored(q, summaries, metadata, layer, kmeans), metadata.kv_len)


def route_chunks(q: torch.Tensor, summaries: torch.Tensor, metadata, layer: int,
                 kmeans: tuple[torch.Tensor, ...] | None = None) -> RoutedKeys:
    """The Triton kernels of route_chunks_ref (same arguments, same result: the scores' sums in another order)."""
    routing = metadata.routing
    B, Hkv, D = metadata.num_seqs, summaries.shape[2], summaries.shape[3]
    K = metadata.max_kv
    C, T = triton.cdiv(max(K, 1), CHUNK), triton.cdiv(max(K, 1), ROUTED_BLOCK_N)
    device = q.device
    scores = torch.empty(B, Hkv, C, dtype=torch.float32, device=device)
    # a pass that writes the cache scores with at most a pure request's rows (PassKeys.q_index's width)
    max_rows = min(metadata.max_q, routing.max_routed_rows) if metadata.write_cache else metadata.max_q
    block_d = max(16, triton.next_power_of_2(D))
    for scored, is_kmeans in ((summaries, False), (kmeans and kmeans[0], True)):
        if not ({"kmeans"} if is_kmeans else {"chunk", "centroid"}) & set(routing.policies):
            continue
        # 16-bit queries and summaries through the tensor cores (the interpreter's 16-bit tl.dot is wrong)
        dot_fp32 = torch.float32 in (q.dtype, scored.dtype) or os.environ.get("TRITON_INTERPRET") == "1"
        _chunk_scores_kernel[(B, Hkv, triton.cdiv(C, SCORE_CHUNKS))](
            q, scored, scores, metadata.cu_seqlens_q, metadata.kv_start, metadata.kv_len, routing.policy,
            routing.pure, max_rows, C, q.stride(0), q.stride(1), scored.stride(0), scored.stride(1),
            scored.stride(2), scores.stride(0), scores.stride(1), D, GROUP=q.shape[1] // Hkv, BLOCK_M=64,
            BLOCK_C=SCORE_CHUNKS, BLOCK_D=block_d, DOT_FP32=dot_fp32, KMEANS=is_kmeans)
    opened = torch.empty(B, Hkv, C, dtype=torch.uint8, device=device)
    hidden = torch.empty(B, Hkv, K, dtype=torch.bool, device=device)
    tiles = torch.empty(B, Hkv, T, dtype=torch.int32, device=device)
    count = torch.empty(B, Hkv, dtype=torch.int32, device=device)
    key_region, region_size = kmeans[1:3] if kmeans is not None else (count, count)  # (unread without kmeans)
    _open_chunks_kernel[(B, Hkv)](
        scores, opened, hidden.view(torch.uint8), tiles, count, routing.keys_read, routing.keys_dense,
        metadata.kv_start, metadata.kv_len, routing.prompt_len, routing.top_k, routing.policy, routing.pure,
        routing.batch_row, key_region, region_size, C, T, K, layer * RANDOM_HASH["layer"] % RANDOM_HASH["modulus"],
        scores.stride(0), scores.stride(1), hidden.stride(0), hidden.stride(1), tiles.stride(0), tiles.stride(1),
        Hkv, BLOCK_C=triton.next_power_of_2(C), WRITE_CHUNKS=WRITE_CHUNKS, TILE_CHUNKS=ROUTED_BLOCK_N // CHUNK,
        KMEANS=kmeans is not None)
    return RoutedKeys(hidden, tiles, count)


if triton is not None:
    # the globals a kernel reads must be constexpr
    _CHUNK, _SINKS, _WINDOW = (tl.constexpr(v) for v in (CHUNK, SINKS, WINDOW))
    _HASH_CHUNK, _HASH_HEAD, _MODULUS = (tl.constexpr(RANDOM_HASH[part]) for part in ("chunk", "head", "modulus"))
    P_CHUNK, P_CENTROID, P_KMEANS, P_WINDOW, P_RANDOM = (tl.constexpr(POLICIES.index(p)) for p in
                                                         ("chunk", "centroid", "kmeans", "window", "random"))

    @triton.jit
    def _exact_dot(a, b, DOT_FP32: tl.constexpr):
        """a @ b in fp32: 16-bit operands' products are exact, so the tensor cores' dot differs from the fp32 one
        only in the order of its sums."""
        if DOT_FP32:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit(do_not_specialize=["max_rows", "C"])
    def _chunk_scores_kernel(q_ptr, sum_ptr, score_ptr, cu_q_ptr, kv_start_ptr, kv_len_ptr, policy_ptr, pure_ptr,
                             max_rows, C, stride_qn, stride_qh, stride_sc, stride_sp, stride_sh, stride_b,
                             stride_h, D, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, KMEANS: tl.constexpr):
        seq, kv_head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        policy = tl.load(policy_ptr + seq)
        if KMEANS:  # sum_ptr: the k-means regions' summaries, laid out as the chunks'
            other = policy != P_KMEANS
        else:
            other = (policy != P_CHUNK) & (policy != P_CENTROID)
        if other | (tl.load(pure_ptr + seq) == 0):
            return
        q_begin = tl.load(cu_q_ptr + seq)
        rows = tl.minimum(tl.load(cu_q_ptr + seq + 1) - q_begin, max_rows)
        kv_len = tl.load(kv_len_ptr + seq)
        o_c = block * BLOCK_C + tl.arange(0, BLOCK_C)
        o_d = tl.arange(0, BLOCK_D)
        m_c = (o_c < C) & (o_c * _CHUNK < kv_len)
        m_cd = m_c[:, None] & (o_d < D)[None, :]
        p_sum = (sum_ptr + (tl.load(kv_start_ptr + seq) // _CHUNK + o_c)[:, None] * stride_sc + kv_head * stride_sh
                 + o_d[None, :])
        lower_part = tl.where(policy == P_CENTROID, 2, 0)  # a centroid is the bound of lo = hi = its mean
        upper_part = tl.where(policy == P_CENTROID, 2, 1)
        b_lo = tl.load(p_sum + lower_part * stride_sp, mask=m_cd, other=0.0)
        b_hi = tl.load(p_sum + upper_part * stride_sp, mask=m_cd, other=0.0)
        if DOT_FP32:
            b_lo, b_hi = b_lo.to(tl.float32), b_hi.to(tl.float32)
        best = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
        o_m = tl.arange(0, BLOCK_M)
        for first in range(0, rows * GROUP, BLOCK_M):  # (row, query head of the KV head) pairs, BLOCK_M at a time
            m_m = first + o_m < rows * GROUP
            row, head = (first + o_m) // GROUP, kv_head * GROUP + (first + o_m) % GROUP
            b_q = tl.load(q_ptr + (q_begin + row)[:, None] * stride_qn + head[:, None] * stride_qh + o_d[None, :],
                          mask=m_m[:, None] & (o_d < D)[None, :], other=0.0)
            if DOT_FP32:
                b_q = b_q.to(tl.float32)
            b_s = (_exact_dot(tl.where(b_q > 0, b_q, 0.0).to(b_q.dtype), tl.trans(b_hi), DOT_FP32)
                   + _exact_dot(tl.where(b_q < 0, b_q, 0.0).to(b_q.dtype), tl.trans(b_lo), DOT_FP32))
            best = tl.maximum(best, tl.max(tl.where(m_m[:, None], b_s, float("-inf")), 0))
        tl.store(score_ptr + seq * stride_b + kv_head * stride_h + o_c, best, mask=o_c < C)

    @triton.jit
    def _region_order(score_ptr, size_ptr, o_c, policy, kv_head, num_kv_heads, random_layer, routable_end, kv_len,
                      C, KMEANS: tl.constexpr):
        """Per region o_c (a chunk, or a k-means region): whether it competes (holds routable keys and has a
        score), its score's order as an int32 (larger: better; -0.0 counted as 0.0) and its weight in the budget
        (a chunk: 1; a k-means region: its keys)."""
        first = o_c * _CHUNK
        competes = (tl.minimum(first + _CHUNK, routable_end) > tl.maximum(first, _SINKS)) & (o_c < C)
        weight = (o_c * 0 + 1).to(tl.int32)
        if KMEANS:
            # (a scalar condition and a vector of them join through tl.where: the interpreter's `&` of the two is
            # int32)
            own = tl.where(policy == P_KMEANS, (o_c < C) & (first < kv_len), False)
            size = tl.load(size_ptr + o_c * num_kv_heads, mask=own, other=0)
            competes = tl.where(policy == P_KMEANS, size > 0, competes)
            weight = tl.where(policy == P_KMEANS, size, weight)
        scored = (policy == P_CHUNK) | (policy == P_CENTROID) | (policy == P_KMEANS)
        score = tl.load(score_ptr + o_c, mask=tl.where(scored, competes, False), other=float("-inf"))
        score = tl.where(policy == P_WINDOW, o_c.to(tl.float32), score)
        hashed = (o_c.to(tl.int64) * _HASH_CHUNK + kv_head.to(tl.int64) * _HASH_HEAD + random_layer) % _MODULUS
        score = tl.where(policy == P_RANDOM, hashed.to(tl.float32), score)
        score = tl.where(score == 0.0, 0.0, score)
        competes = competes & (score > float("-inf"))
        bits = score.to(tl.int32, bitcast=True)
        return competes, bits ^ ((bits >> 31) & 0x7FFFFFFF), weight

    @triton.jit(do_not_specialize=["C", "T", "K", "random_layer", "stride_sb", "stride_sh", "stride_hb",
                                   "stride_hh", "stride_tb", "stride_th"])
    def _open_chunks_kernel(score_ptr, opened_ptr, hidden_ptr, tiles_ptr, count_ptr, read_ptr, dense_ptr,
                            kv_start_ptr, kv_len_ptr, prompt_ptr, top_k_ptr, policy_ptr, pure_ptr, batch_row_ptr,
                            region_ptr, size_ptr, C, T, K, random_layer, stride_sb, stride_sh, stride_hb, stride_hh,
                            stride_tb, stride_th, num_kv_heads, BLOCK_C: tl.constexpr, WRITE_CHUNKS: tl.constexpr,
                            TILE_CHUNKS: tl.constexpr, KMEANS: tl.constexpr):
        seq, kv_head = tl.program_id(0), tl.program_id(1)
        kv_start = tl.load(kv_start_ptr + seq).to(tl.int32)
        kv_len = tl.load(kv_len_ptr + seq).to(tl.int32)
        prompt_len = tl.load(prompt_ptr + seq).to(tl.int32)
        prompt = tl.minimum(prompt_len, kv_len)
        policy = tl.load(policy_ptr + seq).to(tl.int32)
        routed = (policy >= 0) & (tl.load(pure_ptr + seq) != 0)
        routable_end = tl.minimum(prompt_len - _WINDOW, kv_len)  # routable: [_SINKS, end)
        p_score = score_ptr + seq * stride_sb + kv_head * stride_sh
        p_opened = opened_ptr + seq * stride_sb + kv_head * stride_sh
        p_size = size_ptr + (kv_start // _CHUNK) * num_kv_heads + kv_head
        competes, order, weight = _region_order(p_score, p_size, tl.arange(0, BLOCK_C), policy, kv_head,
                                                num_kv_heads, random_layer, routable_end, kv_len, C, KMEANS)
        # The regions opened: the longest run of the ranking (best score first, equal scores in region order)
        # whose weights sum within the budget. `low`: the largest order t whose regions scoring >= t weigh more
        # than the budget (the sentinel below every order when all fit): those above it open, and of those equal
        # to it the first ones that still fit.
        top_k = tl.load(top_k_ptr + seq).to(tl.int32)
        budget = tl.where(policy == P_KMEANS, top_k * _CHUNK, top_k)
        low, high = tl.full([], -2147483649, tl.int64), tl.full([], 2147483647, tl.int64)
        for _ in range(33):
            middle = (low + high + 1) >> 1
            over = tl.sum(tl.where(competes & (order >= middle), weight, 0), 0) > budget
            low, high = tl.where(over, middle, low), tl.where(over, high, middle - 1)
        ties_budget = budget - tl.sum(tl.where(competes & (order > low), weight, 0), 0)
        ties_seen = tl.zeros([], tl.int32)
        for first in range(0, C, WRITE_CHUNKS):
            o_c = first + tl.arange(0, WRITE_CHUNKS)
            block_competes, block_order, block_weight = _region_order(
                p_score, p_size, o_c, policy, kv_head, num_kv_heads, random_layer, routable_end, kv_len, C, KMEANS)
            tie = block_competes & (block_order == low)
            fits = ties_seen + tl.cumsum(tl.where(tie, block_weight, 0), 0) <= ties_budget
            ties_seen += tl.sum(tl.where(tie, block_weight, 0), 0)
            opened = block_competes & ((block_order > low) | (tie & fits))
            tl.store(p_opened + o_c, opened.to(tl.uint8), mask=o_c < C)
        tl.debug_barrier()  # the flags above, read below by other threads of the program
        listed = tl.zeros([], tl.int32)
        read = tl.zeros([], tl.int64)
        o_k = tl.arange(0, _CHUNK)
        p_hidden = hidden_ptr + seq * stride_hb + kv_head * stride_hh
        p_tiles = tiles_ptr + seq * stride_tb + kv_head * stride_th
        for first in range(0, C, WRITE_CHUNKS):
            o_c = first + tl.arange(0, WRITE_CHUNKS)
            key = o_c[:, None] * _CHUNK + o_k[None, :]                                   # [chunks, _CHUNK]
            routable = (key >= _SINKS) & (key < routable_end)
            region = key // _CHUNK
            if KMEANS:  # a key's region: the one the layout's row holds
                held = tl.load(region_ptr + (kv_start + key) * num_kv_heads + kv_head,
                               mask=tl.where(policy == P_KMEANS, routable, False), other=-1)
                region = tl.where(policy == P_KMEANS, held, region)
            flag = tl.load(p_opened + region, mask=tl.where(routed, routable & (region >= 0), False), other=0)
            visible = (key < kv_len) & (~routable | (flag != 0) | ~routed)
            tl.store(p_hidden + key, (~visible).to(tl.uint8), mask=key < K)
            read += tl.sum(tl.sum((visible & (key < prompt)).to(tl.int32), 1), 0).to(tl.int64)
            chunk_read = tl.max(visible.to(tl.int32), 1)
            tile_read = tl.max(tl.reshape(chunk_read, [WRITE_CHUNKS // TILE_CHUNKS, TILE_CHUNKS]), 1)
            o_t = first // TILE_CHUNKS + tl.arange(0, WRITE_CHUNKS // TILE_CHUNKS)
            at = listed + tl.cumsum(tile_read, 0) - 1
            tl.store(p_tiles + at, o_t, mask=(tile_read > 0) & (o_t < T))
            listed += tl.sum(tile_read, 0)
        tl.store(count_ptr + seq * num_kv_heads + kv_head, listed)
        batch_row = tl.load(batch_row_ptr + seq)
        tl.atomic_add(read_ptr + batch_row, read)
        tl.atomic_add(dense_ptr + batch_row, prompt.to(tl.int64))
