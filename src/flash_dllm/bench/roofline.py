"""Hardware floors of the H200 as measured in this project (REFERENCE.md section 6)."""
from __future__ import annotations

from ..config import ModelConfig

HBM_BYTES_PER_S = 4.25e12   # device-to-device copy, read + write
BF16_FLOPS_PER_S = 787e12   # dense bf16 matmul


def forward_flops(cfg: ModelConfig, batch: int, length: int, logit_rows: int) -> float:
    """Matmul FLOPs of one full bidirectional forward: projections and MLP for every token, attention
    over every (query, key) pair, and the LM head for `logit_rows` rows per sequence."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_token_layer = 2 * d * (q + 2 * kv) + 2 * q * d + 2 * 3 * d * cfg.intermediate_size
    attention_layer = 2 * 2 * length * length * q  # QK^T and PV
    body = cfg.num_layers * (batch * length * per_token_layer + batch * attention_layer)
    return body + 2 * batch * logit_rows * d * cfg.vocab_size


def floor_seconds(num_bytes: float, flops: float) -> tuple[float, float, float]:
    """(bytes floor, FLOP floor, the larger of the two) in seconds."""
    memory, compute = num_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S
    return memory, compute, max(memory, compute)
