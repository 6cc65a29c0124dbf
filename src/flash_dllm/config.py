"""Model configuration: one architecture-neutral dataclass, parsed from a checkpoint's config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# config.json keys of the LLaDA (OLMo-style) format that we implement exactly; any other value is refused.
_LLADA_REQUIRED = {
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


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model; never modified after parsing."""

    architecture: str
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

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type != "llada":
            raise ValueError(f"config.json: model_type {model_type!r} is not supported (supported: 'llada')")
        for key, expected in _LLADA_REQUIRED.items():
            if key in cfg and cfg[key] != expected:
                raise ValueError(f"config.json: {key}={cfg[key]!r} is not supported (expected {expected!r})")
        try:
            d_model, n_heads = int(cfg["d_model"]), int(cfg["n_heads"])
            n_layers = int(cfg["n_layers"])
        except KeyError as e:
            raise ValueError(f"config.json: missing required key {e.args[0]!r}") from None
        if d_model % n_heads:
            raise ValueError(f"config.json: d_model ({d_model}) is not divisible by n_heads ({n_heads})")
        mlp = cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d_model)
        include_bias = bool(cfg.get("include_bias", False))
        return cls(
            architecture="llada",
            hidden_size=d_model,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("n_kv_heads") or n_heads),
            head_dim=d_model // n_heads,
            intermediate_size=int(mlp),
            vocab_size=int(cfg.get("embedding_size") or cfg["vocab_size"]),
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
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_dict(read_config_json(path))


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
