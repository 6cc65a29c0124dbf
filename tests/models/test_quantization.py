"""quantization="fp8" and kv_cache_dtype="fp8": the decoder layers' projections loaded as E4M3 weights with
per-channel scales, the model's logits close to the unquantised ones, every method running with each option and
both, the kernel path giving the PyTorch reference's tokens, the FP8 cache holding twice the tokens, and the
combinations they do not support refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_dream import dream_checkpoint

from flash_dllm import LLM, SamplingParams
from flash_dllm.decoding.registry import methods_for
from flash_dllm.kernels.fp8 import FP8, quantize_rows_ref
from flash_dllm.models import load_model, random_model, save_checkpoint
from flash_dllm.models.quantization import Fp8Linear

PROMPTS = [[5, 9, 13, 7], [11, 4, 6, 8, 12, 3, 10]]


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    return dream_checkpoint(tmp_path_factory.mktemp("dream_fp8"))


@pytest.fixture(params=["gqa_checkpoint", "bias_checkpoint", "dream"])
def any_checkpoint(request):
    return request.getfixturevalue(request.param)


def fp8_linears(model) -> dict[str, Fp8Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}


def test_loading_quantises_each_output_channel(any_checkpoint):
    """Each projection's E4M3 values and scales are its checkpoint rows quantised (q|k|v and gate|up shard by
    shard, which per-channel scales make the same as the stacked matrix); dequantised, within half an E4M3 step of
    the float64 weights; everything else loads unchanged."""
    full = load_model(any_checkpoint, "cpu", torch.float32)
    quantised = load_model(any_checkpoint, "cpu", torch.float32, quantization="fp8")
    linears = fp8_linears(quantised)
    assert len(linears) == 4 * full.config.num_layers
    params = dict(full.named_parameters())
    for name, module in linears.items():
        weight = params[f"{name}.weight"].detach()
        values, scale = quantize_rows_ref(weight)
        assert module.weight.dtype == FP8 and torch.equal(module.weight.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(module.weight_scale, scale)
        exact, dequantised = weight.double(), module.weight.double() * module.weight_scale.double()[:, None]
        bound = torch.maximum(exact.abs() * 2 ** -4, module.weight_scale.double()[:, None] * 2 ** -10)
        assert ((dequantised - exact).abs() <= bound * 1.0001).all()
    for name, param in quantised.named_parameters():
        if name.rpartition(".")[0] not in linears or name.endswith("bias"):
            assert torch.equal(param, params[name]), name


@pytest.mark.parametrize("preset", ["llada-tiny", "llada2-tiny"])
def test_random_weights_are_the_unquantised_draw_quantised(preset):
    """Stacked experts too, which are drawn (and quantised) an expert at a time."""
    full = random_model(preset, "cpu", torch.bfloat16, seed=3)
    quantised = random_model(preset, "cpu", torch.bfloat16, seed=3, quantization="fp8")
    params = dict(full.named_parameters())
    for name, module in fp8_linears(quantised).items():
        assert torch.equal(module.weight_scale, quantize_rows_ref(params[f"{name}.weight"]).scale)
    stacks = [(name, module) for name, module in quantised.named_modules() if getattr(module, "fp8_params", ())]
    assert len(stacks) == (2 if preset == "llada2-tiny" else 0)
    for name, module in stacks:
        for stack in module.fp8_params:
            values, scale = quantize_rows_ref(params[f"{name}.{stack}"])
            assert torch.equal(getattr(module, f"{stack}_scale"), scale)
            assert torch.equal(getattr(module, stack).view(torch.uint8), values.view(torch.uint8))
    weight_bytes = lambda model: sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes(quantised) < weight_bytes(full)


@pytest.mark.parametrize("preset", ["llada-tiny", "dream-tiny"])
def test_logits_stay_close_to_the_unquantised_model(preset):
    """At a trained model's weight scale (std 0.02; at 0.3 the tiny random model is chaotic: 0.83) every row's
    logits keep a cosine above 0.995 (a projection alone loses ~3.5%, E4M3's step on both operands)."""
    ids = torch.tensor([PROMPTS[1] * 3])
    logits = {q: random_model(preset, "cpu", torch.float32, seed=1, quantization=q)(ids)[0] for q in (None, "fp8")}
    cosine = F.cosine_similarity(logits["fp8"].double(), logits[None].double(), dim=-1)
    assert not logits["fp8"].isnan().any() and cosine.min() > 0.995


OPTIONS = {"fp8 weights": dict(quantization="fp8"), "fp8 KV": dict(kv_cache_dtype="fp8"),
           "both": dict(quantization="fp8", kv_cache_dtype="fp8")}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("method", sorted(methods_for("bidirectional")))
@pytest.mark.parametrize("checkpoint", ["gqa_checkpoint", "dream"])
def test_every_method_runs_with_each_option(request, checkpoint, method, option):
    llm = LLM(request.getfixturevalue(checkpoint), device="cpu", dtype="float32", kernels=False, **OPTIONS[option])
    outputs = llm.generate(PROMPTS, SamplingParams(method=method, max_tokens=8, block_length=8))
    assert all(out.finish_reason in ("stop", "length") and out.nfe > 0 for out in outputs)


CACHED = [("gqa_checkpoint", dict(method="dual-cache")),
          ("gqa_checkpoint", dict(method="flash-verify", tracking_budget=4, mask_window=8)),
          ("gqa_checkpoint", dict(method="elastic", mask_window=4)),
          ("gqa_checkpoint", dict(method="dual-cache", kv_routing="kmeans", kv_budget=0.5)),
          ("bias_checkpoint", dict(method="dual-cache")),
          ("dream", dict(method="dual-cache"))]


# Each case with FP8 weights and KV cache both; the first also with each alone (CI time: each alone adds ~130 s).
KERNEL_CASES = [(checkpoint, knobs, option) for checkpoint, knobs in CACHED for option in OPTIONS
                if option == "both" or (checkpoint, knobs) == CACHED[0]]


@pytest.mark.parametrize("checkpoint, knobs, option", KERNEL_CASES,
                         ids=lambda v: "-".join(map(str, v.values())) if isinstance(v, dict) else v)
def test_kernels_give_the_reference_tokens(request, checkpoint, knobs, option):
    """The fused quantising kernels round as the references do, and the attention kernel reads the FP8 cache as the
    reference dequantises it, so the tokens are the same (fp32 activations: the interpreter rounds to 16-bit types
    by truncation)."""
    params = SamplingParams(max_tokens=6, block_length=4, threshold=0.5, **knobs)  # blocks of 4 and 2
    outputs = {}
    for kernels in (False, True):
        llm = LLM(request.getfixturevalue(checkpoint), device="cpu", dtype="float32", kernels=kernels,
                  **OPTIONS[option])
        outputs[kernels] = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert outputs[True] == outputs[False]


def test_fp8_cache_holds_twice_the_tokens(gqa_checkpoint):
    budget = 1 << 20
    rows = {}
    for kv_cache_dtype in (None, "fp8"):
        llm = LLM(gqa_checkpoint, device="cpu", dtype="bfloat16", kv_cache_bytes=budget, kv_cache_dtype=kv_cache_dtype)
        llm.generate(PROMPTS[0], SamplingParams(method="dual-cache", max_tokens=8, block_length=8))
        cache = llm.runner.cache
        rows[kv_cache_dtype] = cache.num_rows
        assert cache.nbytes <= budget + cache.nbytes // (cache.num_rows + 1)  # + the scratch row
    assert rows["fp8"] / rows[None] > 1.55  # head_dim 16: 32 / (16 + 4) bytes a head (1.94 at head_dim 128)


def test_unsupported_combinations_are_refused(gqa_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of fp8 or None, got 'int4'"):
        LLM(gqa_checkpoint, device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="batch_invariant=True is not supported with quantization='fp8'"):
        LLM(gqa_checkpoint, device="cpu", quantization="fp8", batch_invariant=True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of fp8 or None, got 'int8'"):
        LLM(gqa_checkpoint, device="cpu", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="batch_invariant=True is not supported with kv_cache_dtype='fp8'"):
        LLM(gqa_checkpoint, device="cpu", kv_cache_dtype="fp8", batch_invariant=True)
    with pytest.raises(ValueError, match="save the original checkpoint"):
        save_checkpoint(load_model(gqa_checkpoint, quantization="fp8"), tmp_path, {})


def test_fp8_model_is_its_fake_quantised_model(monkeypatch):
    """The FP8 model computes what an fp32 model computes with its projections' weights replaced by their E4M3
    values times their scales and each projection's input rounded the same way per row: the loss is E4M3's alone."""
    fp8 = random_model("llada-tiny", "cpu", torch.float32, seed=2, quantization="fp8")
    fake = random_model("llada-tiny", "cpu", torch.float32, seed=2)
    modules, projections = dict(fake.named_modules()), set()
    for name, module in fp8_linears(fp8).items():
        modules[name].weight.copy_(module.weight.float() * module.weight_scale[:, None])
        projections.add(modules[name].weight.data_ptr())
    linear = F.linear

    def fake_quantised_linear(x, weight, bias=None):
        if weight.data_ptr() in projections:  # a weight slice (the queries' rows) starts elsewhere: none here
            rows = quantize_rows_ref(x)
            x = rows.values.float() * rows.scale[..., None]
        return linear(x, weight, bias)
    monkeypatch.setattr(F, "linear", fake_quantised_linear)
    ids = torch.tensor([PROMPTS[1] * 3])
    assert rel_err(fp8(ids), fake(ids)) < 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
