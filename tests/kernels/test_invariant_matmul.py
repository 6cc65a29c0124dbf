"""The batch-invariant GEMM and batched matmul against their references, and a row's result the same for any number
of rows."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.kernels.invariant_matmul import (config_for, invariant_bmm, invariant_bmm_ref, invariant_matmul,
                                                 invariant_matmul_ref, invariant_sum)

SHAPES = {"one-row": (1, 40, 72), "ragged": (70, 130, 200), "wide": (9, 64, 300)}  # (M, K, N), tiles cut


def operands(M, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g).to(dtype).to(DEVICE), torch.randn(N, K, generator=g).to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    x, w = operands(*SHAPES[shape], dtype)
    assert rel_err(invariant_matmul(x, w), invariant_matmul_ref(x, w)) < BUDGET[dtype]


def test_leading_dims_and_no_rows():
    x, w = operands(12, 40, 24, torch.float32)
    assert torch.equal(invariant_matmul(x.view(3, 4, 40), w), invariant_matmul(x, w).view(3, 4, 24))
    assert invariant_matmul(x[:0], w).shape == (0, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_in_any_batch(dtype):
    x, w = operands(70, 130, 200, dtype)
    batched = invariant_matmul(x, w)
    for rows in (slice(0, 1), slice(37, 38), slice(60, 70), slice(3, 68)):
        assert torch.equal(invariant_matmul(x[rows], w), batched[rows])
    assert torch.equal(invariant_matmul(x, w), batched)  # and run to run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [200, 256])  # K cut by the K step, and not
def test_every_tiling_gives_the_same_bits(dtype, K):
    """The table may pick the tiling by the number of rows only because no tiling of rows and columns changes an
    element's sums (the K step is the dtype's one: the interpreter sums a K step at once)."""
    x, w = operands(70, K, 200, dtype)
    k_step = config_for(1, dtype)["BLOCK_K"]
    tilings = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k_step, SWAP=swap, TAIL=tail, num_warps=4, num_stages=3)
               for m, n, swap, tail in ((64, 32, False, 0), (64, 128, False, 0), (128, 64, False, 0),
                                        (32, 64, False, 0), (16, 64, True, 0), (64, 128, True, 0),
                                        (64, 64, True, 16), (32, 64, True, 16))]  # tails: one row tile, three
    first = invariant_matmul(x, w, tilings[0])
    for tiling in tilings[1:]:
        assert torch.equal(invariant_matmul(x, w, tiling), first), tiling


@pytest.mark.parametrize("N", [100, 200])  # the table's narrow (N <= K) and wide tilings
def test_the_tables_tilings_with_a_tail(N):
    """140 rows: a row tile of 128 and a tail of 16 (wide), or 64 and 16 (narrow), in the kernel's second
    accumulator; the reference's result and a row's bits alone."""
    assert config_for(140, torch.bfloat16)["TAIL"] and config_for(140, torch.bfloat16, narrow=True)["TAIL"]
    x, w = operands(140, 130, N, torch.bfloat16)
    batched = invariant_matmul(x, w)
    assert rel_err(batched, invariant_matmul_ref(x, w)) < BUDGET[torch.bfloat16]
    for rows in (slice(0, 1), slice(130, 131), slice(70, 140)):
        assert torch.equal(invariant_matmul(x[rows], w), batched[rows])


BMM_SHAPES = {"one-row": (3, 1, 40, 72), "ragged": (5, 70, 130, 90), "sum": (2, 33, 100, 1)}  # (G, M, K, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", BMM_SHAPES)
def test_bmm_matches_reference(shape, dtype):
    G, M, K, N = BMM_SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*s, generator=g).to(dtype).to(DEVICE) for s in ((G, M, K), (G, K, N)))
    out = invariant_bmm(a, b, torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, invariant_bmm_ref(a, b, torch.float32)) < BUDGET[dtype]
    assert rel_err(invariant_bmm(a.transpose(1, 2).contiguous().transpose(1, 2), b), invariant_bmm_ref(a, b)) \
        < BUDGET[dtype]  # any strides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_an_element_is_the_same_in_any_batch_and_padding(dtype):
    """Fewer groups, fewer rows, fewer columns, or K padded with zeros (a batch's padded key axis): same bits."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 50, 90, generator=g).to(dtype).to(DEVICE), torch.randn(6, 90, 70, generator=g).to(dtype)
    b = b.to(DEVICE)
    full = invariant_bmm(a, b, torch.float32)
    assert torch.equal(invariant_bmm(a[2:3, 7:8], b[2:3, :, 5:6], torch.float32), full[2:3, 7:8, 5:6])
    assert torch.equal(invariant_bmm(a[1:4], b[1:4, :, :40], torch.float32), full[1:4, :, :40])
    padded_a, padded_b = F.pad(a, (0, 77)), F.pad(b, (0, 0, 0, 77))
    assert torch.equal(invariant_bmm(padded_a, padded_b, torch.float32), full)


def test_sum_ignores_trailing_zeros_and_leading_shape():
    x = torch.randn(4, 3, 70, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    total = invariant_sum(x)
    assert total.shape == (4, 3) and rel_err(total, x.double().sum(-1).float()) < BUDGET[torch.float32]
    assert torch.equal(invariant_sum(F.pad(x[1:2], (0, 100))), total[1:2])
