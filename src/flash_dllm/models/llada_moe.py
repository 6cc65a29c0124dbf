"""LLaDA-MoE (LLaDA-MoE-7B-A1B Base/Instruct): LLaDA's masked diffusion over a mixture of experts.

config.json says model_type `llada`, as LLaDA-8B's; only `architectures` tells them apart. Full bidirectional
attention over separate q/k/v projections (MHA) whose query and key heads are RMS-normed before RoPE over the whole
head; every layer routes each token to 8 of 64 SwiGLU experts by the top-8 of a softmax, the probabilities used as
weights as they are (the published code ignores norm_topk_prob, the scaling and the group fields).
"""
from __future__ import annotations

from torch import nn

from .base import DiffusionLM, refuse_unsupported, required_ints
from .moe import MoEConfig, SparseMoE

# config.json keys of the format that we implement exactly; any other value is refused.
_REQUIRED = {
    "hidden_act": "silu",
    "rope_scaling": None,
    "attention_bias": False,
    "partial_rotary_factor": 1,
    "clip_qkv": None,
}


class LLaDAMoEModel(DiffusionLM):
    model_type = "llada"
    architectures = ("LLaDAMoEModelLM", "LLaDAMoEModel")
    checkpoint_names = {
        "embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head",
        "layer": "model.layers.{i}", "attn_norm": "input_layernorm",
        "attention.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "attention.o_proj": "self_attn.o_proj",
        "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
        "mlp_norm": "post_attention_layernorm", "mlp": "mlp",
    }

    @classmethod
    def parse_config(cls, cfg: dict) -> MoEConfig:
        refuse_unsupported(cfg, _REQUIRED)
        if cfg.get("moe_router_score_function") not in (None, "softmax"):
            raise ValueError(f"config.json: moe_router_score_function={cfg['moe_router_score_function']!r} is not "
                             f"supported (expected 'softmax')")
        if cfg.get("moe_router_enable_expert_bias"):
            raise ValueError("config.json: moe_router_enable_expert_bias=true is not supported (the softmax router "
                             "has no expert bias)")
        shared = cfg.get("shared_expert_intermediate_size")
        if shared not in (None, 0, -1):
            raise ValueError(f"config.json: shared_expert_intermediate_size={shared!r} is not supported (the "
                             f"released models have no shared expert)")
        frequencies = cfg.get("moe_layer_freq") or []
        if any(f != 1 for f in frequencies):
            raise ValueError(f"config.json: moe_layer_freq={frequencies!r} is not supported (every layer a mixture "
                             f"of experts)")
        hidden, heads, n_layers, vocab_size, experts, width, per_token = required_ints(
            cfg, "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_experts",
            "expert_intermediate_size", "num_experts_per_tok")
        if hidden % heads:
            raise ValueError(f"config.json: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
        return MoEConfig(
            architecture=cls.architectures[0],
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=hidden // heads,
            intermediate_size=width,  # no dense layer: the experts' width stands in
            vocab_size=vocab_size,
            max_position=int(cfg.get("max_position_embeddings", 8192)),
            rope_theta=float(cfg.get("rope_theta", 50000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            qkv_bias=False,
            linear_bias=False,
            norm_bias=False,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_token_id=cfg.get("mask_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            mask_token="<|mask|>",  # from the tokenizer: config.json gives no mask id
            end_of_turn_tokens=("<|role_end|>",),
            qk_norm=cfg.get("qk_layernorm", True) is not False,
            num_experts=experts,
            experts_per_token=per_token,
            expert_intermediate_size=width,
            router="softmax",
        )

    def feed_forward(self, layer: int) -> nn.Module:
        return SparseMoE(self.shard_config, self.tp)
