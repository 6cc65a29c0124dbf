"""A new architecture is one class and one registry call: a toy one, defined here, that shares LLaDA's model_type
but not its `architectures` name, names its checkpoint's tensors its own way, has a dense first layer and a
two-expert mixture in the others, and takes its special tokens from its own tokenizer. It loads, matches an
independent float64 re-implementation, and decodes with every method (the exact settings of the cached ones give
the uncached tokens). Declared block-causal, its forward follows the blocks, and the cached methods are refused."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import CORPUS, EXACT

from flash_dllm import LLM, SamplingParams
from flash_dllm.config import PRESETS, AttentionPattern, ModelConfig
from flash_dllm.decoding.registry import METHODS
from flash_dllm.models import (ARCHITECTURES, DiffusionLM, LLaDAModel, load_model, parse_config, random_model,
                               register, save_checkpoint)
from flash_dllm.models.layers import GatedMLP
from flash_dllm.models.loader import architecture_of

# ----------------------------------------------------------------------------- the toy architecture

NAME = "ToyMoEForDiffusionLM"
EXPERTS = 2


@dataclasses.dataclass(frozen=True)
class ToyConfig(ModelConfig):  # the architecture's own settings, beside the neutral ones
    num_experts: int = EXPERTS


class TwoExpertMoE(nn.Module):
    """Top-1 of `num_experts` gated MLPs, the chosen one weighted by its softmax probability."""

    def __init__(self, cfg: ToyConfig, tp):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(cfg, tp) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor, kernels: bool = False, invariant: bool = False) -> torch.Tensor:
        probs = self.router(x).float().softmax(dim=-1)
        weight, chosen = probs.max(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, chosen, weight).to(x.dtype)
        return sum(gates[..., e, None] * expert(x, kernels, invariant) for e, expert in enumerate(self.experts))


class ToyMoE(DiffusionLM):
    model_type = "llada"  # LLaDA's: only `architectures` tells them apart
    architectures = (NAME,)
    checkpoint_names = {
        "embed": "backbone.tok_embeddings", "final_norm": "backbone.norm_out", "lm_head": "head",
        "layer": "backbone.layers.{i}", "attn_norm": "norm1", "attention.qkv_proj": ("attn.wq", "attn.wk", "attn.wv"),
        "attention.o_proj": "attn.wo", "mlp_norm": "norm2",
        "mlp.gate_up_proj": ("ffn.w_gate", "ffn.w_up"), "mlp.down_proj": "ffn.w_down",  # the dense first layer
        "mlp.router": "moe.router",
        **{f"mlp.experts.{e}.gate_up_proj": (f"moe.experts.{e}.w_gate", f"moe.experts.{e}.w_up")
           for e in range(EXPERTS)},
        **{f"mlp.experts.{e}.down_proj": f"moe.experts.{e}.w_down" for e in range(EXPERTS)},
    }

    @classmethod
    def parse_config(cls, cfg: dict) -> ToyConfig:
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        block = cfg.get("attention_block_size")
        return ToyConfig(
            architecture=NAME, hidden_size=hidden, num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg["num_key_value_heads"], head_dim=hidden // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            max_position=cfg["max_position_embeddings"], rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"],
            qkv_bias=False, linear_bias=False, norm_bias=False, tie_word_embeddings=False,
            mask_token_id=None, eos_token_id=None, pad_token_id=None, bos_token_id=None,  # from the tokenizer
            attention=AttentionPattern() if block is None else AttentionPattern("block-causal", block),
            mask_token="<|toy_mask|>", end_of_turn_tokens=("<|end_of_reply|>",), num_experts=cfg["num_experts"])

    def feed_forward(self, layer: int) -> nn.Module:
        return GatedMLP(self.shard_config, self.tp) if layer == 0 else TwoExpertMoE(self.shard_config, self.tp)


@pytest.fixture(scope="module", autouse=True)
def toy_architecture():
    register(ToyMoE)
    yield
    del ARCHITECTURES[NAME]


# ----------------------------------------------------------------------------- its checkpoint

CONFIG = {
    "model_type": "llada", "architectures": [NAME], "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 3, "intermediate_size": 48, "num_experts": EXPERTS,
    "vocab_size": 320, "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}
SPECIAL_TOKENS = ("<|toy_eos|>", "<|toy_mask|>", "<|user|>", "<|bot|>", "<|end_of_reply|>")
CHAT_TEMPLATE = ("{% for message in messages %}<|user|>{{ message['content'] }}<|end_of_reply|>{% endfor %}"
                 "{% if add_generation_prompt %}<|bot|>{% endif %}")


def write_toy_tokenizer(path: Path):
    """A byte-level BPE whose special tokens come after its vocabulary (ids unlike LLaDA's), in tokenizer.json;
    tokenizer_config.json names its eos and chat template, not its mask (the architecture does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"] - len(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|toy_eos|>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_toy_checkpoint(path: Path, **overrides) -> Path:
    config = {**CONFIG, **overrides}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_checkpoint(random_model(str(path), "cpu", torch.float32, seed=0, std=0.3), path, config, num_shards=2)
    write_toy_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def block_causal_checkpoint(tmp_path_factory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("toy_block_causal"), attention_block_size=4)


# ----------------------------------------------------------------------------- float64 reference

def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {name: t.double() for file in path.glob("*.safetensors") for name, t in load_file(str(file)).items()}


class Reference:
    """The toy's forward for one unpadded sequence in float64, from its config.json and tensors, with the attention
    mask written out: bidirectional, or with attention_block_size, key j visible to query i iff j // n <= i // n."""

    def __init__(self, path: Path):
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = read_tensors(path)
        self.experts_chosen: set[int] = set()

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * self.w[f"{name}.weight"]

    def lin(self, x, name):
        return x @ self.w[f"{name}.weight"].T

    def mlp(self, x, prefix):
        gate = self.lin(x, f"{prefix}.w_gate")
        return self.lin(gate * torch.sigmoid(gate) * self.lin(x, f"{prefix}.w_up"), f"{prefix}.w_down")

    def rope(self, x, positions):
        half = x.shape[-1] // 2
        inv_freq = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
        angles = positions.double()[:, None, None] * inv_freq
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)

    def mask(self, L: int) -> torch.Tensor:
        block = self.cfg.get("attention_block_size")
        if block is None:
            return torch.ones(L, L, dtype=torch.bool)
        index = torch.arange(L)
        return index[None, :] // block <= index[:, None] // block

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        cfg, L = self.cfg, ids.shape[0]
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd, positions, visible = cfg["hidden_size"] // heads, torch.arange(L), self.mask(L)
        x = self.w["backbone.tok_embeddings.weight"][ids]
        for i in range(cfg["num_hidden_layers"]):
            b = f"backbone.layers.{i}."
            h = self.rms(x, b + "norm1")
            q = self.rope(self.lin(h, b + "attn.wq").view(L, heads, hd), positions)
            k = self.rope(self.lin(h, b + "attn.wk").view(L, kv_heads, hd), positions)
            v = self.lin(h, b + "attn.wv").view(L, kv_heads, hd)
            out = torch.empty_like(q)
            for head in range(heads):
                kv = head // (heads // kv_heads)
                scores = (q[:, head] @ k[:, kv].T / math.sqrt(hd)).masked_fill(~visible, float("-inf"))
                out[:, head] = scores.softmax(dim=-1) @ v[:, kv]
            x = x + self.lin(out.reshape(L, -1), b + "attn.wo")
            h = self.rms(x, b + "norm2")
            if i == 0:
                x = x + self.mlp(h, b + "ffn")
            else:
                probs = self.lin(h, b + "moe.router").softmax(dim=-1)
                expert = probs.argmax(dim=-1)
                self.experts_chosen.update(expert.tolist())
                x = x + torch.stack([probs[t, e] * self.mlp(h[t], f"{b}moe.experts.{e}")
                                     for t, e in enumerate(expert.tolist())])
        return self.lin(self.rms(x, "backbone.norm_out"), "head")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


# ----------------------------------------------------------------------------- loading

def test_architectures_tell_apart_one_model_type():
    llada = PRESETS["llada-tiny"]
    assert architecture_of(CONFIG) is ToyMoE and architecture_of(llada) is LLaDAModel
    unnamed = {k: v for k, v in llada.items() if k != "architectures"}
    assert architecture_of(unnamed) is LLaDAModel  # none listed: the model_type's first entry
    with pytest.raises(ValueError) as error:
        parse_config({**CONFIG, "architectures": ["LLaDA3ModelLM"]})
    assert str(error.value) == ("config.json: model_type 'llada' with architectures ['LLaDA3ModelLM'] is not "
                                "supported (supported: 'llada' (LLaDAModelLM), 'Dream' (DreamModel), 'llada2_moe' "
                                "(LLaDA2MoeModelLM), 'llada' (LLaDAMoEModelLM, LLaDAMoEModel), "
                                f"'llada' ({NAME}))")
    with pytest.raises(ValueError, match=f"an architecture named '{NAME}' is already registered"):
        register(ToyMoE)


def test_checkpoint_has_the_toys_names(toy_checkpoint):
    names = set(read_tensors(toy_checkpoint))
    layer = lambda i, *parts: {f"backbone.layers.{i}.{part}.weight" for part in parts}
    attention = ("norm1", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "norm2")
    experts = [f"moe.experts.{e}.w_{m}" for e in range(EXPERTS) for m in ("gate", "up", "down")]
    assert names == {"backbone.tok_embeddings.weight", "backbone.norm_out.weight", "head.weight",
                     *layer(0, *attention, "ffn.w_gate", "ffn.w_up", "ffn.w_down"),
                     *(name for i in (1, 2) for name in layer(i, *attention, "moe.router", *experts))}


def test_forward_matches_float64_reference(toy_checkpoint):
    model, reference = load_model(toy_checkpoint), Reference(toy_checkpoint)
    assert isinstance(model.config, ToyConfig) and model.config.attention.kind == "bidirectional"
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    for row in range(2):
        assert rel_err(logits[row], reference(ids[row])) < 1e-5
    assert reference.experts_chosen == set(range(EXPERTS))


def test_special_tokens_come_from_its_tokenizer(toy_checkpoint):
    llm = LLM(str(toy_checkpoint), device="cpu", kernels=False)
    vocab = llm.tokenizer.get_vocab()
    assert llm.special.mask_id == vocab["<|toy_mask|>"] >= CONFIG["vocab_size"] - len(SPECIAL_TOKENS)
    assert llm.special.stop_ids == (vocab["<|toy_eos|>"], vocab["<|end_of_reply|>"])
    assert llm.tokenizer.decode(llm.encode("hi")) == "<|user|>hi<|end_of_reply|><|bot|>"


# ----------------------------------------------------------------------------- decoding

PROMPTS = ["What is 3 + 4?", "Tom has 3 apples and buys 4 more. How many?", "x", "The passkey is 48213."]


@pytest.fixture(scope="module")
def llm(toy_checkpoint) -> LLM:
    """Its eos logit scaled up, so that some requests stop early and rows are refilled."""
    llm = LLM(str(toy_checkpoint), device="cpu", dtype="float32", kernels=False, max_batch_size=3,
              kv_cache_bytes=1 << 22)
    llm.model.lm_head.weight[llm.special.stop_ids[0]] *= 2.5
    return llm


@pytest.mark.parametrize("method", [name for name, method in METHODS.items()
                                    if "bidirectional" in method.attention_patterns])
def test_every_method_generates(llm, method):
    params = SamplingParams(method=method, max_tokens=16, block_length=8, temperature=0.5, seed=1)
    outs = llm.generate(PROMPTS, params)
    assert sum(len(out.token_ids) for out in outs) > 0
    for out in outs:
        assert out.error is None and out.finish_reason in ("stop", "length") and isinstance(out.text, str)
        assert all(0 <= t < CONFIG["vocab_size"] and t != llm.special.mask_id for t in out.token_ids)


@pytest.mark.parametrize("method", EXACT)
def test_exact_settings_equal_the_uncached_decoding(llm, method):
    settings, plain_settings = EXACT[method]
    common = dict(max_tokens=32, block_length=8, threshold=0.7)
    cached = llm.generate(PROMPTS, SamplingParams(method=method, **settings, **common))
    plain = llm.generate(PROMPTS, SamplingParams(**plain_settings, **common))
    for a, b in zip(cached, plain):
        assert a.error is None and a.token_ids == b.token_ids and a.steps == b.steps


# ----------------------------------------------------------------------------- block-causal

def test_block_causal_forward_matches_the_masked_reference(block_causal_checkpoint):
    model, reference = load_model(block_causal_checkpoint), Reference(block_causal_checkpoint)
    assert str(model.config.attention) == "block-causal (blocks of 4)"
    ids = torch.randint(0, CONFIG["vocab_size"], (14,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids[None])[0]
        changed = ids.clone()
        changed[8:] = (changed[8:] + 1) % CONFIG["vocab_size"]
        assert torch.equal(model(changed[None])[0, :8], logits[:8])  # blocks 0 and 1 never see block 2 on
    assert rel_err(logits, reference(ids)) < 1e-5
    pads = [0, 5]  # left padding: the blocks start at each row's first real token
    cols = torch.arange(14)
    padded = torch.stack([ids.roll(p) for p in pads])
    with torch.no_grad():
        rows = model(padded, torch.stack([(cols - p).clamp(min=0) for p in pads]),
                     torch.stack([cols >= p for p in pads]))
    for row, p in enumerate(pads):
        assert rel_err(rows[row, p:], reference(ids[:14 - p])) < 1e-5


def test_block_causal_model_refuses_the_cached_methods(block_causal_checkpoint):
    llm = LLM(str(block_causal_checkpoint), device="cpu", kernels=False, kv_cache_bytes=1 << 22)
    [out] = llm.generate(["hi"], SamplingParams(method="dual-cache", max_tokens=8, block_length=4))
    assert out.finish_reason == "error" and "\n" not in out.error
    assert re.search(r"method 'dual-cache' does not support this model's block-causal \(blocks of 4\) attention "
                     r"yet; use reference, parallel, flash-cache, flash-verify, lossless, dream, edit$", out.error)
    [out] = llm.generate(["hi"], SamplingParams(method="parallel", max_tokens=8, block_length=4))
    assert out.error is None and out.token_ids  # block diffusion over its blocks (decoding/block_diffusion.py)
