"""The routed experts of a mixture-of-experts layer: the reference against float64, sort_by_expert's layout, and the
grouped-GEMM kernels (model-dtype and FP8 weights) against their references."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.kernels.moe_experts import (moe_experts, moe_experts_fp8, moe_experts_fp8_ref, moe_experts_ref,
                                            quantize_experts, sort_by_expert, sort_by_expert_ref)

DTYPES = [torch.float32, torch.bfloat16]
# (tokens N, experts E, choices k, hidden d, intermediate I): one token; I not a power of two; 33 tokens, most of
# them on one expert (several blocks); several column blocks and K steps, with tails (d 96, I 80).
SHAPES = [(1, 4, 1, 32, 16), (7, 4, 2, 64, 48), (33, 16, 4, 32, 48), (33, 16, 1, 64, 16), (7, 16, 2, 96, 80)]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu's tails, interpreted


def budget(dtype: torch.dtype) -> float:
    """BUDGET, but 3% for bf16 on the CPU: the interpreter's casts to bf16 truncate, and the six roundings of a row
    (gate, up, silu, product, down, the sum) shrink it by 1.4-1.8%; in fp16, which it rounds to nearest, 99% of the
    elements are bit-identical (test_rounding_order)."""
    return 0.03 if dtype == torch.bfloat16 and DEVICE == "cpu" else BUDGET[dtype]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)


def layer(N, E, k, d, inter, dtype, seed=0):
    """x, topk_ids, topk_weights, w_gate_up, w_down of a routed layer: expert 0 gets no token, expert E - 1 most."""
    scores = randn(N, E, seed=seed)
    scores[:, 0] = -float("inf")
    scores[:, -1] += 2.0
    top = scores.topk(k, dim=-1)
    return (randn(N, d, dtype=dtype, seed=seed + 1), top.indices, top.values.softmax(-1),
            randn(E, 2 * inter, d, dtype=dtype, seed=seed + 2, scale=d ** -0.5),
            randn(E, d, inter, dtype=dtype, seed=seed + 3, scale=inter ** -0.5))


def test_reference_against_float64():
    x, ids, weights, w_gate_up, w_down = layer(5, 4, 2, 32, 24, torch.float32)
    want = torch.zeros(5, 32, dtype=torch.float64, device=DEVICE)
    for n in range(5):
        for j in range(2):
            e = int(ids[n, j])
            gate, up = (w_gate_up[e].double() @ x[n].double()).chunk(2)
            want[n] += weights[n, j].double() * (w_down[e].double() @ (F.silu(gate) * up))
    assert rel_err(moe_experts_ref(x, ids, weights, w_gate_up, w_down), want) < BUDGET[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-e{}-k{}-d{}-i{}".format(*s))
def test_moe_experts_matches_reference(shape, dtype):
    args = layer(*shape, dtype)
    out = moe_experts(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert rel_err(out, moe_experts_ref(*args)) < budget(dtype)


def test_rounding_order():
    """Nearly every element bit-identical in fp16: gate, up, silu, the product and each pair's down projection are
    rounded to x's dtype where the reference rounds them."""
    args = layer(*SHAPES[2], torch.float16)
    assert (moe_experts(*args) == moe_experts_ref(*args)).float().mean().item() > 0.95


@pytest.mark.parametrize("sort", [sort_by_expert_ref, sort_by_expert])
@pytest.mark.parametrize("N,E,k,block_m", [(1, 4, 1, 16), (33, 16, 4, 16), (9, 5, 3, 4), (20, 3, 2, 1),
                                           (200, 64, 8, 16)])
def test_sort_by_expert_layout(sort, N, E, k, block_m):
    """Every pair once, in pair order within its expert; each expert's group whole blocks, the fewest that hold it,
    padding (N k) after its pairs; the blocks used first, in expert order; nothing but padding after them."""
    ids = layer(N, E, k, 16, 16, torch.float32)[1]
    pair_ids, expert_of_block = sort(ids, E, block_m)
    P = N * k
    assert pair_ids.shape == (P + E * (block_m - 1),) and expert_of_block.shape == (pair_ids.numel() // block_m,)
    assert pair_ids.dtype == expert_of_block.dtype == torch.int32
    real = pair_ids < P
    assert torch.equal(pair_ids[real].sort().values.cpu(), torch.arange(P, dtype=torch.int32))
    assert (pair_ids[~real] == P).all()
    counts = torch.bincount(ids.flatten().cpu(), minlength=E)
    want_experts = torch.repeat_interleave(torch.arange(E), (counts + block_m - 1) // block_m)
    used = want_experts.numel()
    assert torch.equal(expert_of_block[:used].cpu(), want_experts.int()) and (expert_of_block[used:] == -1).all()
    assert not real[used * block_m:].any()
    rows = pair_ids[:used * block_m].view(used, block_m).cpu()
    for e in range(E):
        group = rows[want_experts == e].flatten()
        assert torch.equal(group[:counts[e]], (ids.flatten().cpu() == e).nonzero().flatten().int())
        assert (group[counts[e]:] == P).all()


def held_half(ids: torch.Tensor, E: int) -> torch.Tensor:
    """Expert parallelism's ids on the rank that holds experts [0, E / 2): the others' pairs get -1."""
    return torch.where(ids < E // 2, ids, -1)


@pytest.mark.parametrize("sort", [sort_by_expert_ref, sort_by_expert])
def test_pairs_of_another_ranks_experts_are_in_no_block(sort):
    N, E, k, block_m = 33, 16, 4, 16
    ids = held_half(layer(N, E, k, 16, 16, torch.float32)[1], E)
    pair_ids, expert_of_block = sort(ids, E // 2, block_m)
    P, flat = N * k, ids.flatten().cpu()
    real = pair_ids < P
    assert torch.equal(pair_ids[real].sort().values.cpu(), (flat >= 0).nonzero().flatten().int())
    counts = torch.bincount(flat[flat >= 0], minlength=E // 2)
    want_experts = torch.repeat_interleave(torch.arange(E // 2), (counts + block_m - 1) // block_m)
    used = want_experts.numel()
    assert torch.equal(expert_of_block[:used].cpu(), want_experts.int()) and (expert_of_block[used:] == -1).all()
    rows = pair_ids[:used * block_m].view(used, block_m).cpu()
    for e in range(E // 2):
        assert torch.equal(rows[want_experts == e].flatten()[:counts[e]], (flat == e).nonzero().flatten().int())


def test_a_rank_computes_the_pairs_of_its_experts_only():
    """The reference skips ids -1 (the same as the whole stack with those pairs weighted 0); the kernels with
    `foreign` give the reference's result."""
    x, ids, weights, w_gate_up, w_down = layer(*SHAPES[2], torch.float32)
    E = w_gate_up.shape[0]
    held = held_half(ids, E)
    want = moe_experts_ref(x, held, weights, w_gate_up[:E // 2], w_down[:E // 2])
    masked = moe_experts_ref(x, ids, torch.where(held >= 0, weights, 0.0), w_gate_up, w_down)
    assert rel_err(want, masked) < BUDGET[torch.float32]
    out = moe_experts(x, held, weights, w_gate_up[:E // 2], w_down[:E // 2], foreign=True)
    assert rel_err(out, want) < BUDGET[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4]], ids=lambda s: "n{}-e{}-k{}-d{}-i{}".format(*s))
def test_moe_experts_fp8_matches_reference(shape, dtype):
    x, ids, weights, w_gate_up, w_down = layer(*shape, dtype)
    gate_up, down = quantize_experts(w_gate_up), quantize_experts(w_down)
    out = moe_experts_fp8(x, ids, weights, gate_up, down)
    want = moe_experts_fp8_ref(x, ids, weights, gate_up, down)
    assert out.dtype == dtype and rel_err(out, want) < budget(dtype)
    # the quantisation is sane: E4M3's 3 mantissa bits leave a few percent
    assert rel_err(want, moe_experts_ref(x, ids, weights, w_gate_up, w_down)) < 0.1


def test_quantize_experts():
    w = randn(3, 40, 24)
    w[1, 5] = 0.0
    values, scale = quantize_experts(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == w.shape and scale.shape == (3, 40)
    amax = values.float().abs().amax(-1)
    assert amax[1, 5] == 0 and (amax.flatten()[torch.arange(120) != 45] == 448).all()


def test_no_tokens():
    x, ids, weights, w_gate_up, w_down = layer(3, 4, 2, 32, 16, torch.float32)
    assert moe_experts(x[:0], ids[:0], weights[:0], w_gate_up, w_down).shape == (0, 32)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_cuda_graph_replays_new_routing():
    """Captured once (no host syncs), replayed with other tokens and routing: the eager result."""
    x, ids, weights, w_gate_up, w_down = layer(33, 16, 4, 64, 48, torch.bfloat16)
    moe_experts(x, ids, weights, w_gate_up, w_down)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(x, ids, weights, w_gate_up, w_down)
    for static, new in zip((x, ids, weights), layer(33, 16, 4, 64, 48, torch.bfloat16, seed=10)):
        static.copy_(new)
    graph.replay()
    assert torch.equal(out, moe_experts(x, ids, weights, w_gate_up, w_down))
