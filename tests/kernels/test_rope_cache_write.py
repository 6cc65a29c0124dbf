"""The RoPE + cache-write epilogue against its reference, from an FP8 GEMM's unscaled product too; into an fp8
cache, the values it writes into a cache of the model's dtype, quantised; and qkv_rope (the model's entry) on both
of its paths against the fused kernel's reference."""
from kernel_testing import BUDGET, DEVICE, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch
import torch.nn.functional as F
from test_fused_qkv_rope import SHAPES, assert_fp8_writes, make_inputs

from flash_dllm.kernels import fused_qkv_rope as fused
from flash_dllm.kernels.rope_cache_write import rope_cache_write, rope_cache_write_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-h{}-kv{}-hd{}-bias{}-n{}".format(*s))
def test_rope_cache_write_matches_reference(shape, dtype):
    d, heads, kv_heads, head_dim, bias, rows = shape
    x, weight, b, positions, slots, k_ref, v_ref = make_inputs(*shape, dtype)
    qkv = F.linear(x, weight, b)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    q_ref = rope_cache_write_ref(qkv, positions, slots, k_ref, v_ref, heads, 500000.0)
    q_out = rope_cache_write(qkv, positions, slots, k_out, v_out, heads, 500000.0)
    assert q_out.shape == (rows, heads, head_dim) and q_out.dtype == dtype
    for out, ref in ((q_out, q_ref), (k_out, k_ref), (v_out, v_ref)):
        assert rel_err(out, ref) < BUDGET[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-h{}-kv{}-hd{}-bias{}-n{}".format(*s))
def test_fp8_cache_gets_the_quantised_values(shape, dtype):
    heads = shape[1]
    x, weight, b, positions, slots, k_cache, v_cache = make_inputs(*shape, dtype)
    args = (F.linear(x, weight, b), positions, slots)
    assert_fp8_writes(lambda k, v, **scales: rope_cache_write(*args, k, v, heads, 500000.0, **scales),
                      lambda k, v, **scales: rope_cache_write_ref(*args, k, v, heads, 500000.0, **scales),
                      k_cache, v_cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
def test_scaled_product_matches_reference(dtype, bias, fp8):
    """An FP8 GEMM's unscaled product: its row and column scales and the bias applied before RoPE, as the reference
    does (which rounds them to the dtype once)."""
    d, heads, kv_heads, head_dim, _, rows = shape = SHAPES[1]
    _, _, b, positions, slots, k_cache, v_cache = make_inputs(*shape, dtype)
    g = torch.Generator().manual_seed(1)
    features = (heads + 2 * kv_heads) * head_dim
    product = (torch.randn(rows, features, generator=g) * 300).to(dtype).to(DEVICE)  # E4M3 products' magnitudes
    dequant = ((torch.rand(rows, generator=g) * 0.01).to(DEVICE), (torch.rand(features, generator=g) + 0.1).to(DEVICE))
    options = dict(dequant=dequant, bias=b if bias else None)
    args = (product, positions, slots)
    write = lambda k, v, **scales: rope_cache_write(*args, k, v, heads, 500000.0, **scales, **options)
    reference = lambda k, v, **scales: rope_cache_write_ref(*args, k, v, heads, 500000.0, **scales, **options)
    if fp8:
        assert_fp8_writes(write, reference, k_cache, v_cache, dtype)
        return
    k_ref, v_ref, k_out, v_out = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    q_ref, q_out = reference(k_ref, v_ref), write(k_out, v_out)
    for out, ref in ((q_out, q_ref), (k_out, k_ref), (v_out, v_ref)):
        assert rel_err(out, ref) < BUDGET[dtype]
    unscaled = rope_cache_write_ref(product, positions, slots, k_cache.clone(), v_cache.clone(), heads, 500000.0)
    assert rel_err(q_out, unscaled) > 0.5  # the scales were applied


@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
@pytest.mark.parametrize("rows", [20, 150])  # the fused kernel's side of FUSED_MAX_ROWS, then the GEMM's
def test_qkv_rope_matches_the_fused_reference_on_both_paths(rows, fp8):
    shape = (64, 2, 1, 32, True, rows)
    assert (rows <= fused.FUSED_MAX_ROWS) == (rows == 20)
    x, weight, b, positions, slots, k_ref, v_ref = make_inputs(*shape, torch.float32)
    args = (x, weight, b, positions, slots)
    if fp8:  # the scales reach both paths' kernels
        assert_fp8_writes(lambda k, v, **scales: fused.qkv_rope(*args, k, v, 2, 500000.0, **scales),
                          lambda k, v, **scales: fused.fused_qkv_rope_ref(*args, k, v, 2, 500000.0, **scales),
                          k_ref, v_ref, torch.float32)
        return
    k_out, v_out = k_ref.clone(), v_ref.clone()
    q_ref = fused.fused_qkv_rope_ref(*args, k_ref, v_ref, 2, 500000.0)
    q_out = fused.qkv_rope(*args, k_out, v_out, 2, 500000.0)
    for out, ref in ((q_out, q_ref), (k_out, k_ref), (v_out, v_ref)):
        assert rel_err(out, ref) < BUDGET[torch.float32]


def test_no_rows():
    x, weight, b, positions, slots, k_cache, v_cache = make_inputs(*SHAPES[0], torch.float32)
    before = k_cache.clone()
    q = rope_cache_write(F.linear(x, weight, b)[:0], positions[:0], slots[:0], k_cache, v_cache, 4, 500000.0)
    assert q.shape == (0, 4, 16) and torch.equal(k_cache, before)
