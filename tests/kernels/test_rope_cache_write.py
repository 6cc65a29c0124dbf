"""The RoPE + cache-write epilogue against its reference, and qkv_rope (the model's entry) on both of its
paths against the fused kernel's reference."""
from kernel_testing import BUDGET, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch
import torch.nn.functional as F
from test_fused_qkv_rope import SHAPES, make_inputs

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


@pytest.mark.parametrize("rows", [20, 150])  # the fused kernel's side of FUSED_MAX_ROWS, then the GEMM's
def test_qkv_rope_matches_the_fused_reference_on_both_paths(rows):
    shape = (64, 2, 1, 32, True, rows)
    assert (rows <= fused.FUSED_MAX_ROWS) == (rows == 20)
    x, weight, b, positions, slots, k_ref, v_ref = make_inputs(*shape, torch.float32)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    q_ref = fused.fused_qkv_rope_ref(x, weight, b, positions, slots, k_ref, v_ref, 2, 500000.0)
    q_out = fused.qkv_rope(x, weight, b, positions, slots, k_out, v_out, 2, 500000.0)
    for out, ref in ((q_out, q_ref), (k_out, k_ref), (v_out, v_ref)):
        assert rel_err(out, ref) < BUDGET[torch.float32]


def test_no_rows():
    x, weight, b, positions, slots, k_cache, v_cache = make_inputs(*SHAPES[0], torch.float32)
    before = k_cache.clone()
    q = rope_cache_write(F.linear(x, weight, b)[:0], positions[:0], slots[:0], k_cache, v_cache, 4, 500000.0)
    assert q.shape == (0, 4, 16) and torch.equal(k_cache, before)
