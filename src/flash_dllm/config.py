"""Model configuration: one architecture-neutral dataclass (each architecture parses its config.json into it,
models/loader.py picks the architecture by model_type and `architectures`), the attention pattern it declares, and
named presets for random-weight models."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

# Named configurations for random-weight models (`random:NAME`), in the checkpoint's own config.json format.
PRESETS: dict[str, dict] = {
    "llada-8b": {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "block_type": "llama",
        "d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "n_layers": 32, "mlp_hidden_size": 12288,
        "vocab_size": 126464, "embedding_size": 126464, "max_sequence_length": 4096,
        "rope": True, "rope_theta": 500000.0, "rope_full_precision": True, "layer_norm_type": "rms",
        "rms_norm_eps": 1e-5, "layer_norm_with_affine": True, "include_bias": False,
        "include_qkv_bias": False, "attention_layer_norm": False, "input_emb_norm": False,
        "scale_logits": False, "weight_tying": False, "activation_type": "silu",
        "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081, "bos_token_id": 126080,
    },
}
PRESETS["llada-tiny"] = {
    **PRESETS["llada-8b"], "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2,
    "mlp_hidden_size": 128, "vocab_size": 320, "embedding_size": 320, "max_sequence_length": 1024,
    "mask_token_id": 3, "eos_token_id": 1, "pad_token_id": 1, "bos_token_id": 0,
}
PRESETS["dream-7b"] = {
    "model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": 3584, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 28, "attention_dropout": 0.0, "use_cache": False, "torch_dtype": "bfloat16",
    "mask_token_id": 151666, "eos_token_id": 151643, "pad_token_id": 151643, "bos_token_id": 151643,
}
PRESETS["dream-tiny"] = {
    **PRESETS["dream-7b"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 1024,
    "max_window_layers": 2, "mask_token_id": 3, "eos_token_id": 1, "pad_token_id": 1, "bos_token_id": 1,
}


PRESETS["llada2-mini"] = {
    "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "hidden_size": 2048, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120,
    "moe_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "use_qk_norm": True, "use_qkv_bias": False,
    "use_bias": False, "partial_rotary_factor": 0.5, "rope_theta": 600000, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "max_position_embeddings": 32768, "vocab_size": 157184, "tie_word_embeddings": False,
    "mask_token_id": 156895, "eos_token_id": 156892, "pad_token_id": 156892,
}
PRESETS["llada2-flash"] = {
    **PRESETS["llada2-mini"], "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "intermediate_size": 9216, "moe_intermediate_size": 1024,
}
PRESETS["llada2-tiny"] = {
    **PRESETS["llada2-mini"], "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "max_position_embeddings": 1024, "vocab_size": 320,
    "mask_token_id": 3, "eos_token_id": 1, "pad_token_id": 1,
}
PRESETS["llada-moe"] = {
    "model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "expert_intermediate_size": 1024, "num_experts": 64,
    "num_experts_per_tok": 8, "moe_layer_freq": [1] * 16, "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False, "norm_topk_prob": False, "routed_scaling_factor": 1,
    "shared_expert_intermediate_size": None, "qk_layernorm": True, "partial_rotary_factor": 1, "rope_theta": 50000,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "max_position_embeddings": 8192,
    "vocab_size": 157184, "tie_word_embeddings": False, "mask_token_id": 156895, "eos_token_id": 156892,
    "pad_token_id": 156892,
}
PRESETS["llada-moe-tiny"] = {
    **PRESETS["llada-moe"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_layer_freq": [1, 1], "max_position_embeddings": 1024, "vocab_size": 320, "mask_token_id": 3,
    "eos_token_id": 1, "pad_token_id": 1,
}

ATTENTION_KINDS = ("bidirectional", "block-causal")


@dataclass(frozen=True)
class AttentionPattern:
    """Which keys a position attends to in the model's forward. "bidirectional": every position of its sequence;
    "block-causal": the sequence cut into blocks of `block_size` positions from position 0, a position sees its own
    block and every block before it."""

    kind: str = "bidirectional"
    block_size: int | None = None

    def __post_init__(self):
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.kind!r}")
        blocks = self.kind == "block-causal"
        if blocks != (self.block_size is not None) or (blocks and self.block_size <= 0):
            raise ValueError(f"{self.kind} attention takes {'a positive' if blocks else 'no'} block_size, "
                             f"got {self.block_size!r}")

    def __str__(self) -> str:
        return self.kind if self.block_size is None else f"{self.kind} (blocks of {self.block_size})"


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model; never modified after parsing. An architecture with
    settings of its own (experts, ...) subclasses it in its module, its fields with defaults."""

    architecture: str  # the name of the class that builds the model (models/loader.py: ARCHITECTURES)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding and of the LM head (the padded embedding size)
    max_position: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    linear_bias: bool  # biases on every linear layer (include_bias)
    norm_bias: bool    # biases on the RMSNorms (bias_for_layer_norm, which defaults to include_bias)
    tie_word_embeddings: bool
    mask_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None
    attention: AttentionPattern = AttentionPattern()
    # The architecture's names of its tokenizer's mask and end-of-turn tokens, for the ids that config.json and the
    # tokenizer's own settings do not give (tokenizer.special_tokens).
    mask_token: str | None = None
    end_of_turn_tokens: tuple[str, ...] = ()
    # RoPE over the first rotary_dim entries of each head (None: all of them; LLaDA2 rotates half), after an RMSNorm
    # over each query and key head where qk_norm (LLaDA2, LLaDA-MoE).
    rotary_dim: int | None = None
    qk_norm: bool = False
    # The fields that tensor parallelism splits across ranks (an architecture's own widths add theirs), and of
    # those, the experts' widths, which expert parallelism leaves whole (it places whole experts on the ranks).
    split_widths: ClassVar[tuple[str, ...]] = ("intermediate_size",)
    expert_widths: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config: n_heads ({self.num_heads}) must be a multiple of n_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"config: the rotary width must be even and in (0, head_dim={self.head_dim}], got "
                             f"{self.rotary_dim}")

    @property
    def rotary_width(self) -> int:
        """The entries of each head that RoPE rotates (the first ones)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, at 2 bytes per value (bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def read_config_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: config.json is missing from the model directory")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
