"""LLaDA (LLaDA-8B-Base/Instruct, LLaDA-1.5): OLMo-style Llama blocks with bidirectional attention and an
untied LM head, in its checkpoint's names (`model.transformer.blocks.{i}.attn_out.weight`, ...)."""
from __future__ import annotations

from ..config import ModelConfig
from .base import DiffusionLM, refuse_unsupported

# config.json keys of the LLaDA (OLMo-style) format that we implement exactly; any other value is refused.
_REQUIRED = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "rope": True,
    "attention_layer_norm": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "layer_norm_with_affine": True,
    "alibi": False,
}


class LLaDAModel(DiffusionLM):
    model_type = "llada"
    architectures = ("LLaDAModelLM",)
    checkpoint_names = {
        "embed": "model.transformer.wte", "final_norm": "model.transformer.ln_f",
        "lm_head": "model.transformer.ff_out", "layer": "model.transformer.blocks.{i}",
        "attn_norm": "attn_norm", "attention.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "attention.o_proj": "attn_out", "mlp_norm": "ff_norm", "mlp.gate_up_proj": ("ff_proj", "up_proj"),
        "mlp.down_proj": "ff_out",
    }

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelConfig:
        refuse_unsupported(cfg, _REQUIRED)
        try:
            d_model, n_heads = int(cfg["d_model"]), int(cfg["n_heads"])
            n_layers = int(cfg["n_layers"])
            vocab_size = int(cfg.get("embedding_size") or cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json: missing required key {e.args[0]!r}") from None
        if d_model % n_heads:
            raise ValueError(f"config.json: d_model ({d_model}) is not divisible by n_heads ({n_heads})")
        mlp = cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d_model)
        include_bias = bool(cfg.get("include_bias", False))
        return ModelConfig(
            architecture=cls.architectures[0],
            hidden_size=d_model,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("n_kv_heads") or n_heads),
            head_dim=d_model // n_heads,
            intermediate_size=int(mlp),
            vocab_size=vocab_size,
            max_position=int(cfg.get("max_sequence_length", 4096)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            qkv_bias=include_bias or bool(cfg.get("include_qkv_bias", False)),
            linear_bias=include_bias,
            norm_bias=include_bias if cfg.get("bias_for_layer_norm") is None else bool(cfg["bias_for_layer_norm"]),
            tie_word_embeddings=bool(cfg.get("weight_tying", False)),
            mask_token_id=cfg.get("mask_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            mask_token="<|mdm_mask|>",  # LLaDA's tokenizer's names, where config.json gives no ids
            end_of_turn_tokens=("<|eot_id|>",),
        )
