"""The routed experts of a mixture-of-experts layer (SwiGLU experts) as two grouped GEMMs (Triton), beside their
PyTorch reference.

The reference runs one expert at a time: launches per expert, and a host sync to count each expert's pairs. Here
the token-expert pairs are sorted by expert into BLOCK_M-row blocks (sort_by_expert, on the GPU, no host syncs)
and one launch per projection runs every block against its expert's weights. At decode batch sizes a step's cost
is reading the weights of the experts its tokens touch, and one launch reads each of them once per block of pairs
routed to it, with every SM busy. The gate|up launch computes matching gate and up column blocks and writes
silu(gate) * up; the down launch scales each pair's row by its routing weight, and a token's k rows are summed in
fp32. With FP8 experts (moe_experts_fp8) only the weights are E4M3 (the bytes that matter at decode), dequantised
in the kernel; the activations stay in the model's dtype. Under expert parallelism a rank holds some of the experts:
the pairs of the others carry expert id -1 and are skipped (`foreign`).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fp8 import Fp8Rows, quantize_rows_ref
from .silu_mul import silu_mul_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the references work without triton; only the kernels need it
    triton = None


def moe_experts_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """x [N, d], topk_ids [N, k] (experts in [0, E), or -1: none here), topk_weights [N, k] fp32, w_gate_up
    [E, 2 I, d] (gate rows, then up rows), w_down [E, d, I] -> [N, d] in x's dtype: sum_j topk_weights[n, j] *
    down_e(silu(gate_e(x[n])) * up_e(x[n])), e = topk_ids[n, j] >= 0. Each expert in x's dtype; the weighted sum in
    fp32, rounded once."""
    N, k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    # The pairs sorted by expert (the -1s first, then dropped): each expert runs once on its contiguous rows, and one
    # host sync reads the counts. index_select/index_copy, whose gradients are a scatter-add and a gather, keep this
    # path fast under autograd too (training/train_llada2.py trains through it).
    counts = torch.bincount(flat_ids + 1, minlength=w_gate_up.shape[0] + 1).tolist()
    order = flat_ids.argsort(stable=True)[counts[0]:]
    rows = x.index_select(0, order // k)
    y = torch.cat([F.linear(silu_mul_ref(F.linear(part, w_gate_up[expert])), w_down[expert])
                   for expert, part in enumerate(rows.split(counts[1:]))])
    weighted = y.float() * topk_weights.flatten().index_select(0, order)[:, None]
    # Each pair in its own slot, then a token's k slots summed in choice order: the same sums on every device.
    slots = torch.zeros(N * k, x.shape[1], dtype=torch.float32, device=x.device).index_copy(0, order, weighted)
    out = slots.view(N, k, -1).sum(dim=1)
    return out.to(x.dtype)


def quantize_experts(w: torch.Tensor) -> Fp8Rows:
    """Expert weights w [E, out, in] -> values [E, out, in] E4M3 and scale [E, out] fp32: each expert's output
    channel scaled by its absmax / 448, as fp8.quantize_rows_ref quantises rows."""
    return quantize_rows_ref(w)


def dequantize_experts_ref(w: Fp8Rows, dtype: torch.dtype) -> torch.Tensor:
    """values * scale [E, out, in] in `dtype` (the E4M3 values are exact in it; the product rounded once)."""
    return (w.values.float() * w.scale[..., None]).to(dtype)


def moe_experts_fp8_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: Fp8Rows,
                        down: Fp8Rows) -> torch.Tensor:
    """moe_experts_ref with quantize_experts' weights (gate_up [E, 2 I, d], down [E, d, I]) dequantised to x's
    dtype."""
    return moe_experts_ref(x, topk_ids, topk_weights, dequantize_experts_ref(gate_up, x.dtype),
                           dequantize_experts_ref(down, x.dtype))


class ExpertBlocks(NamedTuple):
    """The token-expert pairs (pair id token * k + choice) sorted by expert into blocks of block_m rows (vLLM's
    moe_align_block_size layout), sized by their upper bounds for N k pairs and E experts:
    sorted_pair_ids [N k + E (block_m - 1)] int32: each expert's pairs in pair order, padded with N k (no pair) to a
    whole number of blocks, expert after expert; N k past the last block used. Pairs of expert -1 are in no block.
    expert_of_block [(N k + E (block_m - 1)) // block_m] int32: each block's expert, -1 past the last block used."""
    sorted_pair_ids: torch.Tensor
    expert_of_block: torch.Tensor


def sort_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids [N, k] -> its ExpertBlocks, in PyTorch: a stable sort by expert, then each pair moved to its
    expert's first padded slot + its rank among that expert's pairs. Static shapes and no host syncs."""
    flat = topk_ids.reshape(-1).long()
    num_pairs, device = flat.numel(), flat.device
    held = flat >= 0
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat.clamp(min=0), held.long())
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    shift = (block_end - blocks) * block_m - (counts.cumsum(0) - counts)  # padded slot - unpadded position
    experts, order = torch.sort(torch.where(held, flat, num_experts), stable=True)  # the pairs of none: last
    capacity = num_pairs + num_experts * (block_m - 1)  # at most block_m - 1 padding slots an expert
    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)  # + a bin
    slots = torch.arange(num_pairs, device=device) + F.pad(shift, (0, 1))[experts]
    sorted_pair_ids.scatter_(0, torch.where(experts < num_experts, slots, capacity), order.int())
    sorted_pair_ids = sorted_pair_ids[:capacity]
    expert_of_block = torch.searchsorted(block_end, torch.arange(capacity // block_m, device=device), right=True)
    return ExpertBlocks(sorted_pair_ids, torch.where(expert_of_block < num_experts, expert_of_block, -1).int())


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The Triton kernel of sort_by_expert_ref (same arguments, same result), in one launch: a dozen small
    PyTorch launches were 40-120 us of a decode step's 90-400 (H100, 64 experts, top-8). Graph capturable."""
    if triton is None:
        raise RuntimeError("sort_by_expert needs triton; use sort_by_expert_ref")
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    capacity = num_pairs + num_experts * (block_m - 1)
    out = ExpertBlocks(torch.empty(capacity, dtype=torch.int32, device=flat.device),
                       torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device))
    block_e = triton.next_power_of_2(num_experts)
    block_p = max(16, min(triton.next_power_of_2(num_pairs), 8192 // block_e))  # a [block_p, block_e] one-hot
    _sort_by_expert_kernel[(max(1, triton.cdiv(num_pairs, block_p)),)](
        flat, *out, num_pairs, num_experts, capacity, capacity // block_m, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_P=block_p, num_warps=4)
    return out


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, block_m: int | None = None, foreign: bool = False) -> torch.Tensor:
    """The Triton kernels of moe_experts_ref (same arguments, same result within rounding): two grouped-GEMM
    launches over sort_by_expert's blocks of block_m pairs (default: 16 to 64 by the mean pairs an expert). `foreign`:
    some ids may be -1 (another rank's experts), whose pairs add nothing. Graph capturable."""
    return _moe_experts(x, topk_ids, topk_weights, (w_gate_up, None), (w_down, None), block_m, foreign)


def moe_experts_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: Fp8Rows,
                    down: Fp8Rows, block_m: int | None = None, foreign: bool = False) -> torch.Tensor:
    """The Triton kernels of moe_experts_fp8_ref: moe_experts with E4M3 weights, each weight tile converted to x's
    dtype in the kernel and the fp32 sums scaled by their output channel's scale. Graph capturable."""
    return _moe_experts(x, topk_ids, topk_weights, gate_up, down, block_m, foreign)


def _moe_experts(x, topk_ids, topk_weights, gate_up, down, block_m, foreign):
    if triton is None:
        raise RuntimeError("moe_experts needs triton; use moe_experts_ref")
    (w_gate_up, gate_up_scale), (w_down, down_scale) = gate_up, down
    (N, d), k = x.shape, topk_ids.shape[1]
    E, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    assert w_gate_up.shape == (E, 2 * inter, d) and w_down.shape == (E, d, inter) and topk_ids.shape == (N, k)
    if N == 0:
        return x.new_zeros(0, d)
    num_pairs = N * k
    block_m = block_m or min(64, max(16, triton.next_power_of_2(num_pairs // E)))
    pair_ids, expert_of_block = sort_by_expert(topk_ids, E, block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    w_fp8 = gate_up_scale is not None
    if not w_fp8:  # never read: any pointer will do
        gate_up_scale = down_scale = w_gate_up
    dot_fp32 = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    common = dict(W_FP8=w_fp8, DOT_FP32=dot_fp32, BLOCK_M=block_m)

    products = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # silu(gate) * up of each pair
    tiling = _tiling(inter, d, block_m)
    _gate_up_silu_kernel[(expert_of_block.numel(), triton.cdiv(inter, tiling["BLOCK_N"]))](
        x, w_gate_up, gate_up_scale, pair_ids, expert_of_block, products, num_pairs, d, inter, x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), gate_up_scale.stride(0), products.stride(0), TOPK=k, **tiling,
        **common)

    # weighted down_e rows, by pair id (a foreign pair's row is never written: zero)
    per_pair = (torch.zeros if foreign else torch.empty)(num_pairs, d, dtype=torch.float32, device=x.device)
    tiling = _tiling(d, inter, block_m)
    _down_kernel[(expert_of_block.numel(), triton.cdiv(d, tiling["BLOCK_N"]))](
        products, w_down, down_scale, pair_ids, expert_of_block, topk_weights.reshape(-1).float(), per_pair,
        num_pairs, inter, d, products.stride(0), w_down.stride(0), w_down.stride(1), down_scale.stride(0),
        per_pair.stride(0), **tiling, **common)
    return per_pair.view(N, k, d).sum(1).to(x.dtype)


def _tiling(cols: int, K: int, block_m: int) -> dict:
    """A grouped GEMM's column block, K step and warps, for `cols` outputs of K inputs (tl.dot takes 16 at least)."""
    return dict(BLOCK_N=min(64, max(16, triton.next_power_of_2(cols))),
                BLOCK_K=min(64, max(16, triton.next_power_of_2(K))), num_warps=4)


if triton is not None:
    @triton.jit
    def _one_hot(ids_ptr, o_p, num_pairs, o_e):
        """[BLOCK_P, BLOCK_E] int32: 1 where pair o_p's expert is o_e (none for pairs past num_pairs)."""
        b_e = tl.load(ids_ptr + o_p, mask=o_p < num_pairs, other=-1)
        return (b_e[:, None] == o_e[None, :]).to(tl.int32)

    @triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks"])
    def _sort_by_expert_kernel(ids_ptr, pair_ptr, expert_ptr, num_pairs, num_experts, capacity, num_blocks,
                               BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
        # Program c places pairs c * BLOCK_P.. . Each program counts every pair (the ids are read from L2) for the
        # experts' first slots and the pairs of earlier programs, so no second launch waits for the counts.
        chunk, num_chunks = tl.program_id(0), tl.num_programs(0)
        o_e = tl.arange(0, BLOCK_E)
        b_count = tl.zeros([BLOCK_E], dtype=tl.int32)
        b_before = tl.zeros([BLOCK_E], dtype=tl.int32)  # each expert's pairs before this program's
        for start in range(0, num_pairs, BLOCK_P):
            b_n = tl.sum(_one_hot(ids_ptr, start + tl.arange(0, BLOCK_P), num_pairs, o_e), 0)
            b_count += b_n
            b_before += tl.where(start < chunk * BLOCK_P, b_n, 0)
        b_blocks = (b_count + BLOCK_M - 1) // BLOCK_M
        b_end = tl.cumsum(b_blocks, 0)  # each expert's blocks end here
        b_first = (b_end - b_blocks) * BLOCK_M
        # a pair's slot: its expert's first, past the expert's pairs of earlier programs and earlier in this one
        o_p = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
        b_hot = _one_hot(ids_ptr, o_p, num_pairs, o_e)
        b_slot = tl.sum(b_hot * (tl.cumsum(b_hot, 0) + (b_first + b_before - 1)[None, :]), 1)
        tl.store(pair_ptr + b_slot, o_p, mask=(o_p < num_pairs) & (tl.sum(b_hot, 1) > 0))  # (expert -1: none)
        # the other slots (padding) and the blocks' experts, shared out among the programs
        for start in range(chunk * BLOCK_P, capacity, num_chunks * BLOCK_P):
            o_s = start + tl.arange(0, BLOCK_P)
            m_pair = (o_s[:, None] >= b_first[None, :]) & (o_s[:, None] < (b_first + b_count)[None, :])
            tl.store(pair_ptr + o_s, num_pairs, mask=(o_s < capacity) & (tl.max(m_pair.to(tl.int32), 1) == 0))
        for start in range(chunk * BLOCK_P, num_blocks, num_chunks * BLOCK_P):
            o_b = start + tl.arange(0, BLOCK_P)
            b_expert = tl.sum((b_end[None, :] <= o_b[:, None]).to(tl.int32), 1)
            tl.store(expert_ptr + o_b, tl.where(b_expert < num_experts, b_expert, -1), mask=o_b < num_blocks)

    @triton.jit
    def _dot(a, b, acc, DOT_FP32: tl.constexpr):
        if DOT_FP32:  # exact fp32 products (no tf32); also the interpreter's path, whose 16-bit tl.dot is wrong
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision="ieee")

    # The pair ids, the expert and the number of pairs vary by step: not specialised on (one compile for all).
    @triton.jit(do_not_specialize=["num_pairs"])
    def _gate_up_silu_kernel(x_ptr, w_ptr, scale_ptr, pair_ptr, expert_ptr, out_ptr, num_pairs, K, inter,
                             stride_xm, stride_we, stride_wn, stride_se, stride_om, TOPK: tl.constexpr,
                             W_FP8: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (block of pairs, column block): gate columns o_n and up columns inter + o_n of the block's
        # expert against the block's token rows of x, then silu(gate) * up into the pairs' rows of out.
        block, tile_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(expert_ptr + block).to(tl.int64)
        if expert < 0:  # past the blocks used
            return
        b_pair = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_m = b_pair < num_pairs  # padding rows carry num_pairs
        o_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < inter
        o_k = tl.arange(0, BLOCK_K)
        p_x = x_ptr + (b_pair // TOPK)[:, None] * stride_xm + o_k[None, :]
        p_gate = w_ptr + expert * stride_we + o_n[None, :] * stride_wn + o_k[:, None]  # [BLOCK_K, BLOCK_N]: w.T
        p_up = p_gate + inter * stride_wn
        b_acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            m_k = o_k < K - k * BLOCK_K
            b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
            m_w = m_k[:, None] & m_n[None, :]
            b_gate, b_up = tl.load(p_gate, mask=m_w, other=0.0), tl.load(p_up, mask=m_w, other=0.0)
            if W_FP8:  # E4M3 is exact in x's dtype
                b_gate, b_up = b_gate.to(b_x.dtype), b_up.to(b_x.dtype)
            b_acc_gate = _dot(b_x, b_gate, b_acc_gate, DOT_FP32)
            b_acc_up = _dot(b_x, b_up, b_acc_up, DOT_FP32)
            p_x += BLOCK_K
            p_gate += BLOCK_K
            p_up += BLOCK_K
        if W_FP8:
            p_scale = scale_ptr + expert * stride_se + o_n
            b_acc_gate *= tl.load(p_scale, mask=m_n, other=0.0)[None, :]
            b_acc_up *= tl.load(p_scale + inter, mask=m_n, other=0.0)[None, :]
        # rounded as silu_mul_ref rounds: gate and up (F.linear's results), silu, then the product
        dtype = x_ptr.dtype.element_ty
        b_gate, b_up = b_acc_gate.to(dtype).to(tl.float32), b_acc_up.to(dtype).to(tl.float32)
        b_silu = tl.div_rn(b_gate, 1.0 + tl.exp(-b_gate)).to(dtype).to(tl.float32)
        tl.store(out_ptr + b_pair[:, None] * stride_om + o_n[None, :], (b_silu * b_up).to(out_ptr.dtype.element_ty),
                 mask=m_m[:, None] & m_n[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])
    def _down_kernel(a_ptr, w_ptr, scale_ptr, pair_ptr, expert_ptr, weight_ptr, out_ptr, num_pairs, K, N,
                     stride_am, stride_we, stride_wn, stride_se, stride_om, W_FP8: tl.constexpr,
                     DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (block of pairs, column block): the pairs' rows of a (silu products) times the block's expert's
        # down projection, rounded to a's dtype (F.linear's result), times the pairs' routing weights, in fp32.
        block, tile_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(expert_ptr + block).to(tl.int64)
        if expert < 0:
            return
        b_pair = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_m = b_pair < num_pairs
        o_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        o_k = tl.arange(0, BLOCK_K)
        p_a = a_ptr + b_pair[:, None] * stride_am + o_k[None, :]
        p_w = w_ptr + expert * stride_we + o_n[None, :] * stride_wn + o_k[:, None]
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            m_k = o_k < K - k * BLOCK_K
            b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
            if W_FP8:
                b_w = b_w.to(b_a.dtype)
            b_acc = _dot(b_a, b_w, b_acc, DOT_FP32)
            p_a += BLOCK_K
            p_w += BLOCK_K
        if W_FP8:
            b_acc *= tl.load(scale_ptr + expert * stride_se + o_n, mask=m_n, other=0.0)[None, :]
        b_weight = tl.load(weight_ptr + b_pair, mask=m_m, other=0.0)
        b_y = b_acc.to(a_ptr.dtype.element_ty).to(tl.float32) * b_weight[:, None]
        tl.store(out_ptr + b_pair[:, None] * stride_om + o_n[None, :], b_y, mask=m_m[:, None] & m_n[None, :])
