"""LLaDA2.x (`llada2_moe`) and LLaDA-MoE load from their published layouts (sharded, fused or separate q/k/v, GQA
4/2 and 4/1, stacked experts from one tensor per expert), match an independent float64 re-implementation of the
published forward (block-causal for LLaDA2), take their special tokens from the tokenizer, split under tensor
parallelism into slices of the whole, and refuse unsupported variants and broken checkpoints in one line. LLaDA-MoE
decodes with every method of the bidirectional models (block diffusion: tests/decoding/test_block_diffusion.py)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import EXACT
from moe_checkpoints import Reference, llada2_config, llada_moe_config, rel_err, write_moe_checkpoint

from flash_dllm import LLM, SamplingParams
from flash_dllm.decoding.registry import METHODS
from flash_dllm.config import PRESETS
from flash_dllm.models import build_model, load_model, parse_config
from flash_dllm.models.llada2 import LLaDA2Model
from flash_dllm.models.llada_moe import LLaDAMoEModel
from flash_dllm.models.loader import architecture_of
from flash_dllm.models.parallel import TensorParallel

LAYOUTS = {
    "llada2-gqa2": (llada2_config, {}, 2),
    "llada2-gqa1": (llada2_config, {"num_key_value_heads": 1}, 3),
    "llada-moe": (llada_moe_config, {}, 1),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def moe_checkpoint(request, tmp_path_factory):
    make, overrides, shards = LAYOUTS[request.param]
    return write_moe_checkpoint(tmp_path_factory.mktemp(request.param), make(**overrides), num_shards=shards)


def test_forward_matches_the_published_forward_in_float64(moe_checkpoint):
    model, reference = load_model(moe_checkpoint), Reference(moe_checkpoint)
    ids = torch.randint(0, 300, (2, 45), generator=torch.Generator().manual_seed(1))  # two blocks, the second partial
    with torch.no_grad():
        logits = model(ids)
    for row in range(2):
        assert rel_err(logits[row], reference(ids[row])) < 1e-4
    assert len(reference.experts_chosen) == model.config.num_experts


def test_llada2_attention_is_block_causal(tmp_path):
    path = write_moe_checkpoint(tmp_path, llada2_config(), num_shards=1)
    model = load_model(path)
    assert str(model.config.attention) == "block-causal (blocks of 32)"
    ids = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % 300  # the second block only
    with torch.no_grad():
        before, after = model(ids), model(changed)
    # The first block never sees the second (up to the attention's rounding); inside a block every position sees
    # the others.
    assert (before[0, :32] - after[0, :32]).abs().max() < 1e-4 < (before[0, 32:40] - after[0, 32:40]).abs().max()


def test_published_tensor_names(tmp_path):
    llada2 = set(load_file(str(write_moe_checkpoint(tmp_path / "a", llada2_config(), 1) / "model.safetensors")))
    assert {"model.word_embeddings.weight", "lm_head.weight", "model.layers.0.attention.query_key_value.weight",
            "model.layers.0.attention.query_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias",
            "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.layers.2.attention.dense.weight"} <= llada2
    assert not any(".mlp.experts." in name for name in llada2 if name.startswith("model.layers.0."))
    moe = set(load_file(str(write_moe_checkpoint(tmp_path / "b", llada_moe_config(), 1) / "model.safetensors")))
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.gate_proj.weight"} <= moe
    assert not any("expert_bias" in name or "shared" in name for name in moe)


def test_special_tokens_and_chat_template_come_from_the_tokenizer(tmp_path):
    path = write_moe_checkpoint(tmp_path, llada2_config(), num_shards=1)
    llm = LLM(str(path), device="cpu", kernels=False)
    vocab = llm.tokenizer.get_vocab()
    assert llm.special.mask_id == vocab["<|mask|>"] and llm.special.mask_id >= 300
    assert set(llm.special.stop_ids) == {vocab["<|endoftext|>"], vocab["<|role_end|>"]}
    assert llm.tokenizer.decode(llm.encode("hi")) == "<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>"


def test_llada_moe_shares_llada_s_model_type():
    assert architecture_of(PRESETS["llada-moe"]) is LLaDAMoEModel
    assert architecture_of(PRESETS["llada-8b"]).__name__ == "LLaDAModel"
    assert architecture_of(PRESETS["llada2-mini"]) is LLaDA2Model


@pytest.mark.parametrize("preset, total, experts, dense", [
    ("llada2-mini", 16.26e9, 256, 1), ("llada2-flash", 102.9e9, 256, 1), ("llada-moe", 7.36e9, 64, 0)])
def test_presets_have_the_published_dimensions(preset, total, experts, dense):
    model = build_model(parse_config(PRESETS[preset]), "meta", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(total, rel=2e-3)
    assert model.config.num_experts == experts and model.config.dense_layers == dense
    assert model.config.vocab_size == 157184 and model.config.mask_token_id == 156895


def test_tensor_parallel_ranks_hold_slices_of_the_whole(tmp_path):
    """Each rank's experts hold its part of every expert's intermediate dimension, its fused q|k|v rows its heads'
    q, k and v rows (a GQA 4/2 model: one KV head a rank)."""
    path = write_moe_checkpoint(tmp_path, llada2_config(), num_shards=2)
    tensors = {name: t for file in path.glob("*.safetensors") for name, t in load_file(str(file)).items()}
    split = set()
    for rank in range(2):
        shard = load_model(path, tp=TensorParallel(rank, 2))
        params = dict(shard.named_parameters())
        for name, placement in shard.checkpoint_layout().items():
            local = params[placement.param] if placement.rows is None else params[placement.param][placement.rows]
            expected = tensors[name] if placement.shard is None else placement.shard.of(tensors[name])
            assert torch.equal(local, expected), name
            if placement.shard is not None:
                split.add(name)
    assert {"model.layers.0.attention.query_key_value.weight", "model.layers.1.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
            "model.layers.0.mlp.up_proj.weight"} <= split


@pytest.mark.parametrize("make, change, message", [
    (llada2_config, {"score_function": "softmax"},
     r"config.json: score_function='softmax' is not supported \(expected 'sigmoid'\)"),
    (llada_moe_config, {"moe_router_score_function": "sigmoid"},
     r"config.json: moe_router_score_function='sigmoid' is not supported \(expected 'softmax'\)"),
    (llada2_config, {"num_experts_per_tok": 9}, r"config: num_experts_per_tok must be in \[1, num_experts=8\], got 9"),
    (llada2_config, {"n_group": 3}, r"config: 8 experts in 3 groups keeping 2 is not a valid grouping"),
    (llada_moe_config, {"shared_expert_intermediate_size": 64},
     r"config.json: shared_expert_intermediate_size=64 is not supported"),
    (llada2_config, {"num_experts": None}, r"config.json: a required key is null"),
])
def test_unsupported_variants_are_refused_by_field(make, change, message):
    with pytest.raises(ValueError, match=message):
        parse_config(make(**change))


def test_broken_expert_tensors_are_named(tmp_path):
    path = write_moe_checkpoint(tmp_path, llada2_config(), num_shards=1)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    save_file({n: t for n, t in tensors.items() if n != name}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"checkpoint is missing tensors: {name}"):
        load_model(path)
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{name}' has shape \[64, 31\], but config.json "
                                         rf"implies \[64, 32\]"):
        load_model(path)
    config = json.loads((path / "config.json").read_text())
    assert config["moe_intermediate_size"] == 32


# ----------------------------------------------------------------------------- LLaDA-MoE decodes with every method

@pytest.fixture(scope="module")
def llada_moe_llm(tmp_path_factory):
    path = write_moe_checkpoint(tmp_path_factory.mktemp("llada-moe"), llada_moe_config(), num_shards=2)
    return LLM(str(path), device="cpu", dtype="float32", kernels=False)


PROMPTS = ["What is 3 + 4?", "x = 5\nprint(x)", "The passkey is"]


@pytest.mark.parametrize("method", [m for m in METHODS if m != "edit"])
def test_llada_moe_runs_every_method(llada_moe_llm, method):
    params = SamplingParams(method=method, max_tokens=16, block_length=8, temperature=0.5, seed=1)
    outs = llada_moe_llm.generate(PROMPTS, params)
    for out in outs:
        assert out.error is None and out.finish_reason in ("stop", "length")
        assert all(t != llada_moe_llm.special.mask_id for t in out.token_ids)


@pytest.mark.parametrize("method", EXACT)
def test_llada_moe_cached_methods_at_exact_settings_equal_the_uncached(llada_moe_llm, method):
    settings, plain_settings = EXACT[method]
    common = dict(max_tokens=32, block_length=8, threshold=0.7)
    cached = llada_moe_llm.generate(PROMPTS, SamplingParams(method=method, **settings, **common))
    plain = llada_moe_llm.generate(PROMPTS, SamplingParams(**plain_settings, **common))
    for a, b in zip(cached, plain):
        assert a.error is None and a.token_ids == b.token_ids and a.steps == b.steps
