"""Tiny checkpoints of the mixture-of-experts dLLMs in their published layouts (LLaDA2.x `llada2_moe`, LLaDA-MoE),
with a tokenizer in their family's layout (special tokens after the vocabulary, the mask id from the tokenizer,
`<role>HUMAN</role>...<|role_end|>` chat turns), and an independent float64 re-implementation of their forward
from config.json and the tensors, written from the published modeling code."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import CORPUS

from flash_dllm.config import PRESETS
from flash_dllm.models import random_model, save_checkpoint

SPECIAL_TOKENS = ("<|endoftext|>", "<|mask|>", "<|role_end|>", "<role>", "</role>")
CHAT_TEMPLATE = ("{% for message in messages %}<role>{{ {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': "
                 "'ASSISTANT'}[message['role']] }}</role>{{ message['content'] }}<|role_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}")


def llada2_config(**overrides) -> dict:
    """A tiny llada2_moe config.json (GQA 4/2, first layer dense, 8 experts in 4 groups, top-2, a shared expert),
    with no mask id: it comes from the tokenizer, as the released configs'."""
    config = {**PRESETS["llada2-tiny"], **overrides}
    del config["mask_token_id"]
    return config


def llada_moe_config(**overrides) -> dict:
    config = {**PRESETS["llada-moe-tiny"], **overrides}
    del config["mask_token_id"]
    return config


def write_tokenizer(path: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def write_moe_checkpoint(path: Path, config: dict, num_shards: int = 2, seed: int = 0, std: float = 0.3) -> Path:
    """Random weights saved under the format's own names, its tokenizer beside them; config.json's eos id is the
    tokenizer's."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(path, config["vocab_size"])
    config = {**config, "eos_token_id": tokenizer.token_to_id("<|endoftext|>"),
              "pad_token_id": tokenizer.token_to_id("<|endoftext|>")}
    (path / "config.json").write_text(json.dumps(config))
    save_checkpoint(random_model(str(path), "cpu", torch.float32, seed=seed, std=std), path, config,
                    num_shards=num_shards)
    return path


class Reference:
    """The published forward of one unpadded sequence in float64, from config.json and the tensors (both formats):
    llada2_moe under its block-causal mask (blocks of 32 from position 0), LLaDA-MoE bidirectional."""

    def __init__(self, path: Path):
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = {name: t.double() for file in path.glob("*.safetensors") for name, t in load_file(str(file)).items()}
        self.llada2 = self.cfg["model_type"] == "llada2_moe"
        self.experts_chosen: set[int] = set()

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * weight

    def lin(self, x, name):
        return x @ self.w[f"{name}.weight"].T

    def mlp(self, x, prefix):
        gate = self.lin(x, f"{prefix}.gate_proj")
        return self.lin(gate * torch.sigmoid(gate) * self.lin(x, f"{prefix}.up_proj"), f"{prefix}.down_proj")

    def rope(self, x, positions):
        head_dim = x.shape[-1]
        dim = int(head_dim * self.cfg.get("partial_rotary_factor", 1))
        inv_freq = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.cat([positions.double()[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
        rot, rest = x[..., :dim], x[..., dim:]
        half = torch.cat([-rot[..., dim // 2:], rot[..., :dim // 2]], dim=-1)
        return torch.cat([rot * angles.cos() + half * angles.sin(), rest], dim=-1)

    def moe(self, h, prefix):
        cfg, k = self.cfg, self.cfg["num_experts_per_tok"]
        logits = self.lin(h, f"{prefix}.gate")
        if self.llada2:
            scores = torch.sigmoid(logits)
            biased = scores + self.w[f"{prefix}.gate.expert_bias"]
            groups = biased.view(len(h), cfg["n_group"], -1)
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter(1, group_scores.topk(cfg["topk_group"], dim=-1).indices, 1)
            masked = biased.masked_fill(~keep.bool().repeat_interleave(groups.shape[-1], dim=1), -math.inf)
            chosen = masked.topk(k, dim=-1).indices
            weights = scores.gather(1, chosen)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg["routed_scaling_factor"]
        else:
            weights, chosen = logits.softmax(dim=-1).topk(k, dim=-1)
        out = torch.zeros_like(h)
        for t in range(len(h)):
            for j in range(k):
                e = int(chosen[t, j])
                self.experts_chosen.add(e)
                out[t] += weights[t, j] * self.mlp(h[t], f"{prefix}.experts.{e}")
        if self.llada2 and cfg.get("num_shared_experts"):
            out = out + self.mlp(h, f"{prefix}.shared_experts")
        return out

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        cfg, L = self.cfg, ids.shape[0]
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        positions, index = torch.arange(L), torch.arange(L)
        visible = (index[None] // 32 <= index[:, None] // 32) if self.llada2 else torch.ones(L, L, dtype=torch.bool)
        x = self.w["model.word_embeddings.weight" if self.llada2 else "model.embed_tokens.weight"][ids]
        for i in range(cfg["num_hidden_layers"]):
            b = f"model.layers.{i}."
            h = self.rms(x, self.w[b + "input_layernorm.weight"])
            if self.llada2:
                qkv = self.lin(h, b + "attention.query_key_value").view(L, heads + 2 * kv_heads, hd)
                q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
                q_norm, k_norm, out_name = "attention.query_layernorm", "attention.key_layernorm", "attention.dense"
            else:
                q, k, v = (self.lin(h, b + f"self_attn.{p}_proj").view(L, -1, hd) for p in "qkv")
                q_norm, k_norm, out_name = "self_attn.q_norm", "self_attn.k_norm", "self_attn.o_proj"
            q = self.rope(self.rms(q, self.w[b + q_norm + ".weight"]), positions)
            k = self.rope(self.rms(k, self.w[b + k_norm + ".weight"]), positions)
            out = torch.empty_like(q)
            for head in range(heads):
                kv = head // (heads // kv_heads)
                scores = (q[:, head] @ k[:, kv].T / math.sqrt(hd)).masked_fill(~visible, -math.inf)
                out[:, head] = scores.softmax(dim=-1) @ v[:, kv]
            x = x + self.lin(out.reshape(L, -1), b + out_name)
            h = self.rms(x, self.w[b + "post_attention_layernorm.weight"])
            dense = self.llada2 and i < cfg.get("first_k_dense_replace", 0)
            x = x + (self.mlp(h, b + "mlp") if dense else self.moe(h, b + "mlp"))
        return self.lin(self.rms(x, self.w["model.norm.weight"]), "lm_head")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()
