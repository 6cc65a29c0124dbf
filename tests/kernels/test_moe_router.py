"""The MoE router kernel against models.moe.route: LLaDA2's grouped sigmoid router with its bias, a small grouped
one, an ungrouped one, and LLaDA-MoE's softmax router. Random continuous logits (no exact ties, whose order
torch.topk leaves unspecified): the chosen experts identical, in the same order, the weights to fp32 rounding."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

from types import SimpleNamespace

import pytest
import torch

from flash_dllm.kernels.moe_router import route_kernel
from flash_dllm.models.moe import route


def config(E, k, router="sigmoid", groups=1, kept=1, normalize=False, scaling=1.0):
    return SimpleNamespace(num_experts=E, experts_per_token=k, router=router, expert_groups=groups,
                           groups_kept=kept, normalize_weights=normalize, routed_scaling=scaling)


# name -> (config, with an expert bias)
CONFIGS = {
    "llada2": (config(256, 8, groups=8, kept=4, normalize=True, scaling=2.5), True),
    "grouped-small": (config(16, 2, groups=4, kept=2, normalize=True, scaling=1.5), True),
    "ungrouped-sigmoid": (config(16, 4, normalize=True), False),
    "ungrouped-sigmoid-bias": (config(24, 3, scaling=2.0), True),  # E not a power of two, no normalisation
    "llada-moe": (config(64, 8, router="softmax"), False),
    "softmax-small": (config(16, 2, router="softmax", normalize=True, scaling=0.5), False),
}


def inputs(N, E, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(N, E, generator=g)).to(DEVICE)
    expert_bias = (0.1 * torch.randn(E, generator=g)).to(DEVICE) if bias else None
    return logits, expert_bias


def check(logits, cfg, expert_bias):
    chosen, weights = route_kernel(logits, cfg, expert_bias)
    want_chosen, want_weights = route(logits, cfg, expert_bias)
    assert chosen.dtype == want_chosen.dtype == torch.int64 and weights.dtype == torch.float32
    assert chosen.shape == weights.shape == want_chosen.shape
    assert torch.equal(chosen, want_chosen)
    assert rel_err(weights, want_weights) < BUDGET[torch.float32]


@pytest.mark.parametrize("N", [1, 7, 33])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_kernel_matches_route(name, N):
    cfg, bias = CONFIGS[name]
    logits, expert_bias = inputs(N, cfg.num_experts, bias, seed=N)
    check(logits, cfg, expert_bias)


def test_bias_moves_groups_and_experts():
    """A bias large enough to decide: the kept groups and the chosen experts follow the biased scores, while the
    weights stay the unbiased ones (a kernel weighing by the biased scores, or grouping unbiased, fails)."""
    cfg, _ = CONFIGS["grouped-small"]
    logits, _ = inputs(7, 16, False, seed=3)
    expert_bias = torch.zeros(16, device=DEVICE)
    expert_bias[[1, 6, 13]] = 2.0  # groups 0, 1 and 3 hold a boosted expert; only two of them are kept
    check(logits, cfg, expert_bias)
    chosen, _ = route_kernel(logits, cfg, expert_bias)
    assert torch.isin(chosen, torch.tensor([1, 6, 13], device=DEVICE)).all()


def test_strided_logits():
    """Logits that are a column slice of a wider tensor (a row stride larger than E)."""
    cfg, bias = CONFIGS["llada-moe"]
    wide, _ = inputs(7, 80, False, seed=5)
    check(wide[:, 8:72], cfg, None)
    cfg, bias = CONFIGS["grouped-small"]
    wide, expert_bias = inputs(7, 20, True, seed=6)
    check(wide[:, 2:18], cfg, expert_bias[:16])


def test_ties_go_to_the_lowest_index():
    """Saturated sigmoids (exact ties at 1.0) without a bias: the lowest indices first, for groups and experts."""
    cfg, _ = CONFIGS["grouped-small"]
    logits = torch.full((2, 16), 30.0, device=DEVICE)
    chosen, weights = route_kernel(logits, cfg, None)
    assert chosen.tolist() == [[0, 1], [0, 1]]
    assert torch.equal(weights, torch.full((2, 2), 0.75, device=DEVICE))  # 1 / 2 * 1.5


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the interpreter's max of a NaN row
def test_nan_rows_stay_in_bounds():
    """A NaN logit ranks first (as in torch.topk) and its weight is NaN; every chosen index is a real expert."""
    for name in ("llada2", "llada-moe"):
        cfg, bias = CONFIGS[name]
        logits, expert_bias = inputs(3, cfg.num_experts, bias)
        logits[0, 5] = float("nan")
        logits[1] = float("nan")
        chosen, weights = route_kernel(logits, cfg, expert_bias)
        assert ((chosen >= 0) & (chosen < cfg.num_experts)).all()
        assert chosen[0, 0] == 5 and weights[:2].isnan().all()
        want_chosen, want_weights = route(logits[2:], cfg, expert_bias)
        assert torch.equal(chosen[2:], want_chosen) and rel_err(weights[2:], want_weights) < BUDGET[torch.float32]


def test_empty_and_bad_configs():
    cfg, _ = CONFIGS["llada-moe"]
    chosen, weights = route_kernel(torch.empty(0, 64, device=DEVICE), cfg, None)
    assert chosen.shape == weights.shape == (0, 8)
    with pytest.raises(ValueError):
        route_kernel(torch.zeros(2, 16, device=DEVICE), config(16, 8, groups=4, kept=1), None)
