"""The router of a mixture-of-experts layer (LLaDA2.x's grouped sigmoid router, LLaDA-MoE's softmax router) in one
Triton launch; the PyTorch reference is models.moe.route.

The reference is a chain of small launches per layer: sigmoid, the bias add, an unflatten, two top-ks for the
groups, a scatter, a repeat_interleave and a masked fill, the top-k of the experts, a gather, the normalisation
and the scaling, each reading and writing [N, E] fp32. At decode N is a few dozen rows, so the step pays a dozen
launches (and their gaps) per MoE layer for microseconds of arithmetic. Here one program holds a block of rows with
all of their experts in registers (E padded to a power of two) and writes only the k chosen experts and weights.

The top-ks are repeated argmax-and-mask passes (k = 8, a row at most 256 experts: cheaper than a sort, and in the
same order as torch.topk's sorted output, so `chosen` matches the reference's column for column). A group's score
(the sum of its 2 best biased scores) comes from masking the row to the group, not from a [rows, groups, per-group]
reshape, so neither E nor the group size need be a power of two. Ties (equal scores, e.g. sigmoids saturated at 1.0 with
equal biases) go to the lowest index, for the groups and the experts; torch.topk leaves its order unspecified. The
softmax router picks by the logits themselves: the softmax is monotonic, and its rounding could only merge
distinct logits into ties. A NaN ranks above every number (as in torch.topk), its weight stays NaN, and the chosen
indices always lie in [0, E): a broken row cannot send the expert kernels out of bounds.

The router GEMM (x @ router_weight.T) is not fused: a program must hold all E logits of its rows, so a fused
launch would read the whole router weight once per block of rows, over the few programs that decode's few rows
give (a fraction of the SMs), where the GEMM alone spreads that read over the whole GPU.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference (models.moe.route) works without triton; only the kernel needs it
    triton = None

ROW_ELEMENTS = 2048  # rows x padded experts a program holds (E = 256: 8 rows; E = 64: 32)


def route_kernel(logits: torch.Tensor, cfg, expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of models.moe.route (same arguments, same result): router logits [N, E] (fp32) -> the
    chosen experts [N, k] int64, in descending (biased) score, and their weights [N, k] fp32 (to fp32 rounding).
    cfg: a MoEConfig, or anything with its router, experts_per_token, expert_groups, groups_kept,
    normalize_weights and routed_scaling. Graph capturable (no host syncs)."""
    if triton is None:
        raise RuntimeError("route_kernel needs triton; use models.moe.route")
    N, E = logits.shape
    k, groups = cfg.experts_per_token, cfg.expert_groups
    softmax = cfg.router == "softmax"
    if cfg.router not in ("softmax", "sigmoid"):
        raise ValueError(f"route_kernel: unknown router {cfg.router!r}")
    if softmax:  # the reference ignores the bias and the groups of a softmax router
        expert_bias, groups = None, 1
    if not 0 < k <= E or E % groups or (groups > 1 and (  # as MoEConfig checks them
            not 0 < cfg.groups_kept <= groups or E // groups < 2 or cfg.groups_kept * (E // groups) < k)):
        raise ValueError(f"route_kernel: top-{k} of {E} experts in {groups} groups keeping {cfg.groups_kept}")
    chosen = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(N, k, dtype=torch.float32, device=logits.device)
    if N == 0:
        return chosen, weights
    block_e = triton.next_power_of_2(E)
    block_n = max(1, min(triton.next_power_of_2(N), ROW_ELEMENTS // block_e))
    bias = expert_bias.contiguous() if expert_bias is not None else logits  # else a placeholder, never read
    _route_kernel[(triton.cdiv(N, block_n),)](
        logits, bias, chosen, weights, N, E, logits.stride(0), logits.stride(1), float(cfg.routed_scaling),
        K=k, GROUPS=groups, GROUPS_KEPT=cfg.groups_kept if groups > 1 else 1, PER_GROUP=E // groups,
        SOFTMAX=softmax, HAS_BIAS=expert_bias is not None, NORMALIZE=bool(cfg.normalize_weights),
        BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
        BLOCK_G=triton.next_power_of_2(groups), num_warps=4)
    return chosen, weights


if triton is not None:
    @triton.jit
    def _first_best(b_score, b_avail, o_e, BLOCK_E: tl.constexpr):
        """Per row of b_score [rows, BLOCK_E]: the lowest index among its largest available entries (BLOCK_E if
        none is available), and that entry."""
        b_masked = tl.where(b_avail, b_score, float("-inf"))
        best = tl.max(b_masked, 1)
        first = tl.min(tl.where(b_avail & (b_masked == best[:, None]), o_e[None, :], BLOCK_E), 1)
        return first, best

    @triton.jit(do_not_specialize=["N", "stride_n"])
    def _route_kernel(x_ptr, bias_ptr, chosen_ptr, weights_ptr, N, E, stride_n, stride_e, scaling,
                      K: tl.constexpr, GROUPS: tl.constexpr, GROUPS_KEPT: tl.constexpr, PER_GROUP: tl.constexpr,
                      SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
        """Rows [program * BLOCK_N, + BLOCK_N): b_rank (what the top-k ranks: the biased sigmoid scores, or the
        logits), b_weight (what it weighs by: the unbiased scores, or the softmax), b_avail (the experts still
        open: real ones, in kept groups, not yet chosen)."""
        o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        o_e = tl.arange(0, BLOCK_E)
        o_k = tl.arange(0, BLOCK_K)
        m_n = o_n < N
        b_real = (o_e[None, :] < E) & (o_n[:, None] >= 0)  # [BLOCK_N, BLOCK_E]
        b_x = tl.load(x_ptr + o_n[:, None].to(tl.int64) * stride_n + o_e[None, :] * stride_e,
                      mask=m_n[:, None] & b_real, other=0.0).to(tl.float32)
        if SOFTMAX:
            b_x = tl.where(b_real, b_x, float("-inf"))  # padding: exp(-inf) = 0
            top = tl.max(b_x, 1)
            top = tl.where(top == top, top, 0.0)  # a NaN row: NaN weights, as the reference's
            b_exp = tl.exp(b_x - top[:, None])
            b_weight = b_exp / tl.sum(b_exp, 1)[:, None]
            b_rank = b_x
        else:
            b_weight = tl.sigmoid(b_x)
            b_rank = b_weight
            if HAS_BIAS:
                b_rank += tl.load(bias_ptr + o_e, mask=o_e < E, other=0.0).to(tl.float32)[None, :]
        b_rank = tl.where(b_rank == b_rank, b_rank, float("inf"))  # NaN ranks first, as in torch.topk
        b_avail = b_real
        if GROUPS > 1:  # keep the GROUPS_KEPT groups whose 2 best scores sum highest
            o_g = tl.arange(0, BLOCK_G)
            group_of = o_e // PER_GROUP  # padding: groups >= GROUPS
            b_group = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
            for g in tl.static_range(GROUPS):
                b_in = b_real & (group_of[None, :] == g)
                first, best = _first_best(b_rank, b_in, o_e, BLOCK_E)
                b_in = b_in & (o_e[None, :] != first[:, None])  # the second best may equal the best
                _second_first, second = _first_best(b_rank, b_in, o_e, BLOCK_E)
                b_group = tl.where(o_g[None, :] == g, (best + second)[:, None], b_group)
            b_group_open = (o_g[None, :] < GROUPS) & (o_n[:, None] >= 0)
            b_kept = (o_e[None, :] < 0) & (o_n[:, None] >= 0)  # all false
            for _kept in tl.static_range(GROUPS_KEPT):
                g_best, _score = _first_best(b_group, b_group_open, o_g, BLOCK_G)
                b_group_open = b_group_open & (o_g[None, :] != g_best[:, None])
                b_kept = b_kept | (group_of[None, :] == g_best[:, None])
            b_avail = b_avail & b_kept
        b_chosen = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
        b_out = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for j in tl.static_range(K):
            pick, _pick_score = _first_best(b_rank, b_avail, o_e, BLOCK_E)
            pick = tl.minimum(pick, E - 1)  # never out of bounds (the config leaves k experts open)
            b_hit = o_e[None, :] == pick[:, None]
            b_chosen = tl.where(o_k[None, :] == j, pick[:, None], b_chosen)
            b_out = tl.where(o_k[None, :] == j, tl.sum(tl.where(b_hit, b_weight, 0.0), 1)[:, None], b_out)
            b_avail = b_avail & ~b_hit
        if NORMALIZE:
            b_out = b_out / (tl.sum(b_out, 1)[:, None] + 1e-20)
        b_out = b_out * scaling
        o_out = o_n[:, None].to(tl.int64) * K + o_k[None, :]
        m_out = m_n[:, None] & (o_k[None, :] < K)
        tl.store(chosen_ptr + o_out, b_chosen.to(tl.int64), mask=m_out)
        tl.store(weights_ptr + o_out, b_out, mask=m_out)
