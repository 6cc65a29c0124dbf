"""Hardware floors of the H200 (measured: a device-to-device copy and a dense bf16 matmul), and the bytes and
FLOPs of the engine's passes."""
from __future__ import annotations

from ..config import ModelConfig

HBM_BYTES_PER_S = 4.25e12   # device-to-device copy, read + write
BF16_FLOPS_PER_S = 787e12   # dense bf16 matmul


def layer_params(cfg: ModelConfig) -> int:
    """Matmul weights of one transformer layer: QKV and output projections, gated MLP."""
    d = cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return d * (q + 2 * kv) + q * d + 3 * d * cfg.intermediate_size


def forward_flops(cfg: ModelConfig, batch: int, length: int, logit_rows: int) -> float:
    """Matmul FLOPs of one full bidirectional forward: projections and MLP for every token, attention
    over every (query, key) pair, and the LM head for `logit_rows` rows per sequence."""
    q = cfg.num_heads * cfg.head_dim
    attention_layer = 2 * 2 * length * length * q  # QK^T and PV
    body = cfg.num_layers * (batch * length * 2 * layer_params(cfg) + batch * attention_layer)
    return body + 2 * batch * logit_rows * cfg.hidden_size * cfg.vocab_size


def iteration_cost(cfg: ModelConfig, batch: int, keys: int, query_rows: float, passes: float,
                   weight_bytes: int, kv_bytes_per_key: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decoding iteration over `batch` requests of `keys` tokens each that makes
    `passes` forward passes and computes `query_rows` query rows per request (summed over its passes).

    FLOPs = 2 x non-embedding matmul params x query rows + attention (QK^T and PV of every query row against
    all `keys` keys, in every layer). The LM head on the used rows is left out (at most a few % of the FLOPs
    here), so the floor stays a lower bound.
    Bytes = per pass, the weights it reads (`weight_bytes`) and the K and V of every key of every request,
    once (from the cache, or the fresh K/V of a full pass); activations are left out."""
    q = cfg.num_heads * cfg.head_dim
    flops = batch * query_rows * cfg.num_layers * (2 * layer_params(cfg) + 2 * 2 * keys * q)
    return passes * (weight_bytes + batch * keys * kv_bytes_per_key), flops


def weight_bytes_read(model) -> int:
    """Bytes of the weights a forward pass reads: all but the input embedding, of which it gathers only the
    used rows (unless the LM head shares it and reads it whole)."""
    embedding = model.embed.weight
    gathered = 0 if model.config.tie_word_embeddings else embedding.numel() * embedding.element_size()
    return sum(p.numel() * p.element_size() for p in model.parameters()) - gathered


def floor_seconds(num_bytes: float, flops: float) -> tuple[float, float, float]:
    """(bytes floor, FLOP floor, the larger of the two) in seconds."""
    memory, compute = num_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S
    return memory, compute, max(memory, compute)
