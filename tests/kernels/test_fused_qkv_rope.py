"""Fused QKV + RoPE + cache write against its PyTorch reference, and the reference against the model; into an fp8
cache, the values it writes into a cache of the model's dtype, quantised."""
from kernel_testing import BUDGET, DEVICE, e4m3_steps, rel_err  # first: it picks the interpreter on the CPU

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.kernels.fused_qkv_rope import fused_qkv_rope, fused_qkv_rope_ref
from flash_dllm.kernels.fp8 import quantize_rows_ref
from flash_dllm.models.layers import apply_rotary, rotary_cos_sin

# (d_model, heads, kv heads, head_dim, bias, rows): MHA; GQA with biases, head_dim 24 (half not a power of
# two) and d_model 96 (a partial K tile); LLaDA-like d_model 384; head_dim 96 (a head in two column chunks,
# the second partial); the many-row tiling (more rows than one tile) with LLaDA's head_dim 128.
SHAPES = [(64, 4, 4, 16, False, 9), (96, 4, 2, 24, True, 37), (384, 6, 2, 64, False, 20),
          (64, 2, 1, 32, True, 150), (64, 2, 2, 96, True, 20), (64, 2, 1, 128, False, 300),
          (128, 7, 1, 128, True, 40)]  # Dream-7B's head: 7 query heads per KV head, q/k/v biases


def make_inputs(d, heads, kv_heads, head_dim, bias, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, d, generator=g).to(dtype)
    weight = (torch.randn(features, d, generator=g) * d ** -0.5).to(dtype)
    b = torch.randn(features, generator=g).to(dtype) if bias else None
    positions = torch.randint(0, 4096, (rows,), generator=g)  # large angles, as late in a sequence
    num_rows = 2 * rows + 5
    slot_mapping = torch.randperm(num_rows, generator=g)[:rows]
    cache = [torch.randn(num_rows, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    to = lambda t: None if t is None else t.to(DEVICE)
    return [to(t) for t in (x, weight, b, positions, slot_mapping, *cache)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-h{}-kv{}-hd{}-bias{}-n{}".format(*s))
def test_fused_qkv_rope_matches_reference(shape, dtype):
    d, heads, kv_heads, head_dim, bias, rows = shape
    x, weight, b, positions, slots, k_ref, v_ref = make_inputs(*shape, dtype)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    q_ref = fused_qkv_rope_ref(x, weight, b, positions, slots, k_ref, v_ref, heads, 500000.0)
    q_out = fused_qkv_rope(x, weight, b, positions, slots, k_out, v_out, heads, 500000.0)
    assert q_out.shape == (rows, heads, head_dim) and q_out.dtype == dtype
    for out, ref in ((q_out, q_ref), (k_out, k_ref), (v_out, v_ref)):  # the caches' other rows unchanged too
        assert rel_err(out, ref) < BUDGET[dtype]


def fp8_cache(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The cache in E4M3 (kernels/kv_fp8.py): K and V values, and their scales as keyword arguments."""
    (k_values, k_scale), (v_values, v_scale) = quantize_rows_ref(k_cache), quantize_rows_ref(v_cache)
    return k_values, v_values, dict(k_scale=k_scale, v_scale=v_scale)


def assert_fp8_close(written: tuple, ref: tuple, dtype):
    """(k, v, scales) of an fp8 cache against the reference's: each value within one E4M3 step (a rounding near a
    tie, or under a scale an ulp apart, may go the other way) and the scales within the dtype's budget."""
    for values, ref_values in zip(written[:2], ref[:2]):
        assert e4m3_steps(values, ref_values) <= 1
    for name, scale in written[2].items():
        assert rel_err(scale, ref[2][name]) < BUDGET[dtype]


def assert_fp8_writes(write, reference, k_cache, v_cache, dtype):
    """write(k, v, **scales) -> q into an fp8 cache writes quantize_rows_ref of what it writes into a cache of the
    model's dtype (which the other tests compare with the reference) and returns the same q. In fp32 its fp8 cache is
    also the reference's (`reference`, the same call); a 16-bit projection or rotation rounds as the reference's only
    within the dtype's budget (the interpreter's casts to bf16 truncate), which RoPE's cancellations turn into
    several E4M3 steps of the smaller values."""
    k_plain, v_plain = k_cache.clone(), v_cache.clone()
    q_plain = write(k_plain, v_plain)
    written = fp8_cache(k_cache, v_cache)
    assert rel_err(write(*written[:2], **written[2]), q_plain) < BUDGET[dtype]
    assert_fp8_close(written, fp8_cache(k_plain, v_plain), dtype)
    if dtype == torch.float32:
        ref = fp8_cache(k_cache, v_cache)
        reference(*ref[:2], **ref[2])
        assert_fp8_close(written, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-h{}-kv{}-hd{}-bias{}-n{}".format(*s))
def test_fp8_cache_gets_the_quantised_values(shape, dtype):
    """Whole heads per program (up to 32 rows, other tiles than into a cache of the model's dtype)."""
    heads = shape[1]
    x, weight, b, positions, slots, k_cache, v_cache = make_inputs(*shape, dtype)
    inputs = (x, weight, b, positions, slots)
    assert_fp8_writes(lambda k, v, **scales: fused_qkv_rope(*inputs, k, v, heads, 500000.0, **scales),
                      lambda k, v, **scales: fused_qkv_rope_ref(*inputs, k, v, heads, 500000.0, **scales),
                      k_cache, v_cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models_qkv_rope_and_cache_write(dtype):
    """Bit for bit what LLaDABlock.cached_attention computes (projection, rotary_cos_sin, apply_rotary)."""
    d, heads, kv_heads, head_dim, bias, rows = SHAPES[1]
    x, weight, b, positions, slots, k_cache, v_cache = make_inputs(*SHAPES[1], dtype)
    k_model, v_model = k_cache.clone(), v_cache.clone()
    q = fused_qkv_rope_ref(x, weight, b, positions, slots, k_cache, v_cache, heads, 500000.0)

    cos, sin = rotary_cos_sin(positions, head_dim, 500000.0)
    q_m, k_m, v_m = F.linear(x, weight, b).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    k_model[slots] = apply_rotary(k_m.view(rows, kv_heads, head_dim), cos, sin)
    v_model[slots] = v_m.view(rows, kv_heads, head_dim)
    assert torch.equal(q, apply_rotary(q_m.view(rows, heads, head_dim), cos, sin))
    assert torch.equal(k_cache, k_model) and torch.equal(v_cache, v_model)


def test_no_rows():
    x, weight, b, positions, slots, k_cache, v_cache = make_inputs(*SHAPES[0], torch.float32)
    before = k_cache.clone()
    q = fused_qkv_rope(x[:0], weight, b, positions[:0], slots[:0], k_cache, v_cache, 4, 500000.0)
    assert q.shape == (0, 4, 16) and torch.equal(k_cache, before)
