"""Model configuration: one architecture-neutral dataclass (each architecture parses its config.json into it,
models/loader.py picks the architecture by model_type and `architectures`), the attention pattern it declares, and
named presets for random-weight models."""
from __future__ import annotations

import json
from dataclasses import dataclass
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
