"""LLaDA2.0 / LLaDA2.1 (mini, flash; model_type `llada2_moe`): block diffusion over a mixture of experts.

Attention is block-causal (blocks of 32 from position 0: bidirectional inside a block, causal across blocks), over a
fused q|k|v projection (GQA) whose query and key heads are RMS-normed, then rotated over their first half
(partial RoPE). The first `first_k_dense_replace` layers keep a gated MLP; the others route each token to 8 of 256
experts by sigmoid scores within the best 4 of 8 groups, plus one shared expert (models/moe.py).
"""
from __future__ import annotations

from torch import nn

from ..config import AttentionPattern
from .base import DiffusionLM, refuse_unsupported, required_ints
from .layers import GatedMLP
from .moe import MoEConfig, SparseMoE

# config.json keys of the format that we implement exactly; any other value is refused.
_REQUIRED = {
    "hidden_act": "silu",
    "score_function": "sigmoid",
    "use_bias": False,
    "rope_scaling": None,
    "use_linear_attention": False,
    "norm_head": False,
}
BLOCK_SIZE = 32  # the attention blocks of the published generate() (block_length) and of training


class LLaDA2Model(DiffusionLM):
    model_type = "llada2_moe"
    architectures = ("LLaDA2MoeModelLM",)
    checkpoint_names = {
        "embed": "model.word_embeddings", "final_norm": "model.norm", "lm_head": "lm_head",
        "layer": "model.layers.{i}", "attn_norm": "input_layernorm",
        "attention.qkv_proj": "attention.query_key_value", "attention.o_proj": "attention.dense",
        "attention.q_norm": "attention.query_layernorm", "attention.k_norm": "attention.key_layernorm",
        "mlp_norm": "post_attention_layernorm",
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": "mlp.down_proj",  # dense layers
        "mlp": "mlp",
        "mlp.shared.gate_up_proj": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
        "mlp.shared.down_proj": "mlp.shared_experts.down_proj",
    }

    @classmethod
    def parse_config(cls, cfg: dict) -> MoEConfig:
        refuse_unsupported(cfg, _REQUIRED)
        hidden, heads, n_layers, vocab_size, experts, width, per_token = required_ints(
            cfg, "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_experts",
            "moe_intermediate_size", "num_experts_per_tok")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rotary = int(cfg.get("rotary_dim") or head_dim * float(cfg.get("partial_rotary_factor", 1.0)))
        block = int(cfg.get("block_size") or BLOCK_SIZE)
        return MoEConfig(
            architecture=cls.architectures[0],
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(cfg.get("intermediate_size") or width),
            vocab_size=vocab_size,
            max_position=int(cfg.get("max_position_embeddings", 32768)),
            rope_theta=float(cfg.get("rope_theta", 600000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=bool(cfg.get("use_qkv_bias", False)),
            linear_bias=False,
            norm_bias=False,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_token_id=cfg.get("mask_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            attention=AttentionPattern("block-causal", block),
            mask_token="<|mask|>",  # the tokenizer's names, where config.json gives no ids
            end_of_turn_tokens=("<|role_end|>",),
            rotary_dim=rotary,
            qk_norm=bool(cfg.get("use_qk_norm", True)),
            num_experts=experts,
            experts_per_token=per_token,
            expert_intermediate_size=width,
            shared_intermediate_size=width * int(cfg.get("num_shared_experts") or 0),
            dense_layers=int(cfg.get("first_k_dense_replace", 0)),
            router="sigmoid",
            expert_groups=int(cfg.get("n_group") or 1),
            groups_kept=int(cfg.get("topk_group") or 1),
            normalize_weights=per_token > 1,  # the published gate divides by the sum whenever it picks several
            routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
            expert_bias=bool(cfg.get("moe_router_enable_expert_bias", True)),
        )

    def feed_forward(self, layer: int) -> nn.Module:
        cfg = self.shard_config
        return GatedMLP(cfg, self.tp) if layer < cfg.dense_layers else SparseMoE(cfg, self.tp)
