"""Dream (Dream-v0-Instruct-7B, Dream-v0-Base-7B): Qwen2.5 blocks with bidirectional attention, q/k/v biases,
an untied LM head and shifted logits, in its checkpoint's names (`model.layers.{i}.self_attn.q_proj.bias`, ...)."""
from __future__ import annotations

from ..config import ModelConfig
from .base import DiffusionLM, refuse_unsupported, required_ints

# config.json keys of the Dream (Qwen2) format that we implement exactly; any other value is refused.
_REQUIRED = {
    "hidden_act": "silu",
    "use_sliding_window": False,
    "rope_scaling": None,
}


class DreamModel(DiffusionLM):
    model_type = "Dream"
    architectures = ("DreamModel",)
    logit_shift = 1
    vocab_merges_tokenizer = "Qwen2TokenizerFast"  # the HF repo's remote-code DreamTokenizer is Qwen2's
    checkpoint_names = {
        "embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head",
        "layer": "model.layers.{i}", "attn_norm": "input_layernorm",
        "attention.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "attention.o_proj": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": "mlp.down_proj",
    }

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelConfig:
        refuse_unsupported(cfg, _REQUIRED)
        hidden, n_heads, n_layers, intermediate, vocab_size = required_ints(
            cfg, "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
        if hidden % n_heads:
            raise ValueError(f"config.json: hidden_size ({hidden}) is not divisible by num_attention_heads "
                             f"({n_heads})")
        return ModelConfig(
            architecture=cls.architectures[0],
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=hidden // n_heads,
            intermediate_size=intermediate,
            vocab_size=vocab_size,
            max_position=int(cfg.get("max_position_embeddings", 32768)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=True,  # Dream's modeling code gives q/k/v biases unconditionally (no config key)
            linear_bias=False,
            norm_bias=False,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mask_token_id=cfg.get("mask_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            mask_token="<|mask|>",  # Qwen2's tokenizer's names, where config.json gives no ids
            end_of_turn_tokens=("<|im_end|>",),
        )
