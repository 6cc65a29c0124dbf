"""Greedy tokens and their confidences over the vocabulary (Triton), beside the PyTorch reference.

The reference (the sampler's greedy path) copies each row's logits to float64, fills the mask id with -inf
(another copy), takes the argmax, then a softmax (a third copy) and gathers the token's probability: several
passes over [rows, vocab] in 8-byte floats, the largest cost of a step's sampling (H200, batch 32 x 32 block
columns over LLaDA's 126k vocabulary: ~4.5 of a Dual-Cache step's 32 ms). The kernel reads the logits once
(twice from L2) and writes two numbers per row.

Each row's vocabulary is cut into a fixed number of splits (a function of the vocabulary size alone, so a row's
numbers do not depend on the batch). A program takes one split: its largest logit, its best non-mask logit and
the first index that holds it, and its sum of exp(x - largest) in float64; a second kernel merges the splits in
order. The probability is exp(best - max) / sum, in float64 as in the reference (whose softmax sums in another
order: the two differ in the last bits of a float64).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without triton; only the kernel needs it
    triton = None


SPLIT_SIZE = 16384  # vocabulary entries per program (LLaDA: 8 splits; batch 1's 16-32 rows: 128-256 programs)
BLOCK_V = 2048


def greedy_tokens_ref(logits: torch.Tensor, mask_id: int,
                      scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (the argmax over the vocabulary without the mask id [...] int64, its softmax probability
    over the whole vocabulary [...] float64). Ties go to the first index. scores (float64, the sampler's noisy
    logits): ranked instead of the logits."""
    logits = logits.double()
    scores = logits if scores is None else scores
    scores = scores.index_fill(-1, torch.full((1,), mask_id, device=logits.device), float("-inf"))
    tokens = scores.argmax(dim=-1)
    return tokens, torch.softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def greedy_tokens(logits: torch.Tensor, mask_id: int,
                  split_size: int = SPLIT_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of greedy_tokens_ref (same arguments, the same tokens, the probability to float64's last
    bits). split_size: vocabulary entries per program (a multiple of BLOCK_V; tests use small ones)."""
    if triton is None:
        raise RuntimeError("greedy_tokens needs triton; use greedy_tokens_ref")
    R, V = logits.shape
    assert logits.stride(-1) == 1 and split_size % BLOCK_V == 0
    splits = triton.cdiv(V, split_size)
    tokens = torch.empty(R, dtype=torch.long, device=logits.device)
    confidence = torch.empty(R, dtype=torch.float64, device=logits.device)
    if R == 0:
        return tokens, confidence
    # per (row, split): the largest logit, the best non-mask logit and its index, the sum of exp(x - largest)
    top, best = (torch.empty(R, splits, device=logits.device) for _ in range(2))
    where = torch.empty(R, splits, dtype=torch.long, device=logits.device)
    total = torch.empty(R, splits, dtype=torch.float64, device=logits.device)
    _split_kernel[(R, splits)](logits, top, best, where, total, logits.stride(0), V, mask_id, split_size,
                               BLOCK_V=BLOCK_V, num_warps=8)
    _merge_kernel[(R,)](top, best, where, total, tokens, confidence, splits, V,
                        BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return tokens, confidence


if triton is not None:
    @triton.jit(do_not_specialize=["stride_r", "mask_id"])
    def _split_kernel(x_ptr, top_ptr, best_ptr, where_ptr, total_ptr, stride_r, V, mask_id, split_size,
                      BLOCK_V: tl.constexpr):
        row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
        splits = tl.num_programs(1)
        p_row = x_ptr + row * stride_r
        first = split * split_size
        end = tl.minimum(first + split_size, V)
        b_top = tl.full([BLOCK_V], float("-inf"), tl.float32)
        b_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        b_where = tl.full([BLOCK_V], V, tl.int32)  # per lane: the first index of its best (V: none yet)
        for start in range(first, end, BLOCK_V):
            o_v = start + tl.arange(0, BLOCK_V)
            b_x = tl.load(p_row + o_v, mask=o_v < end, other=float("-inf")).to(tl.float32)
            b_top = tl.maximum(b_top, b_x)
            # a lane's later entries have larger indices: only a larger logit, or its first entry, replaces
            better = (o_v < end) & (o_v != mask_id) & ((b_x > b_best) | (b_where == V))
            b_where = tl.where(better, o_v, b_where)
            b_best = tl.where(better, b_x, b_best)
        top = tl.max(b_top, 0)
        best = tl.max(b_best, 0)
        where = tl.min(tl.where(b_best == best, b_where, V), 0)
        top_safe = tl.where(top == float("-inf"), 0.0, top).to(tl.float64)
        b_total = tl.zeros([BLOCK_V], tl.float64)
        for start in range(first, end, BLOCK_V):  # the split again, from L2: exp(x - top) in float64
            o_v = start + tl.arange(0, BLOCK_V)
            b_x = tl.load(p_row + o_v, mask=o_v < end, other=float("-inf")).to(tl.float64)
            b_total += tl.exp(b_x - top_safe)
        p_out = row * splits + split
        tl.store(top_ptr + p_out, top)
        tl.store(best_ptr + p_out, best)
        tl.store(where_ptr + p_out, where.to(tl.int64))
        tl.store(total_ptr + p_out, tl.sum(b_total, 0))

    @triton.jit
    def _merge_kernel(top_ptr, best_ptr, where_ptr, total_ptr, tokens_ptr, confidence_ptr, S, V,
                      BLOCK_S: tl.constexpr):
        """Row (program 0): the largest logit over the splits, the sum rescaled to it, the first split holding
        the best non-mask logit (splits are in index order; V: a split without a candidate), and that logit's
        probability."""
        row = tl.program_id(0).to(tl.int64)
        o_s = tl.arange(0, BLOCK_S)
        m_s = o_s < S
        b_top = tl.load(top_ptr + row * S + o_s, mask=m_s, other=float("-inf"))
        b_best = tl.load(best_ptr + row * S + o_s, mask=m_s, other=float("-inf"))
        b_where = tl.load(where_ptr + row * S + o_s, mask=m_s, other=V)
        b_total = tl.load(total_ptr + row * S + o_s, mask=m_s, other=0.0)
        top = tl.max(b_top, 0)
        top_safe = tl.where(top == float("-inf"), 0.0, top).to(tl.float64)
        b_scale = tl.exp(tl.where(m_s, b_top.to(tl.float64) - top_safe, float("-inf")))  # 0 for an empty split
        total = tl.sum(b_total * b_scale, 0)
        b_best = tl.where(b_where < V, b_best, float("-inf"))
        best = tl.max(b_best, 0)
        first = tl.min(tl.where((b_where < V) & (b_best == best), o_s, BLOCK_S), 0)
        token = tl.sum(tl.where(o_s == first, b_where, 0), 0)
        tl.store(tokens_ptr + row, token)
        tl.store(confidence_ptr + row, tl.exp(best.to(tl.float64) - top_safe) / total)
