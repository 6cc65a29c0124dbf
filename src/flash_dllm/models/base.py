"""What an architecture is to the engine: `DiffusionLM`, a stack of pre-norm decoder layers between a
token embedding and an LM head, with bidirectional attention.

An architecture subclasses it with three things: `parse_config` (its config.json -> ModelConfig),
`checkpoint_names` (its tensor names for the generic modules) and `logit_shift` (0: row i of the logits
predicts position i; 1: row i comes from hidden state i - 1, as in Dream). The engine, the decoding methods,
the benchmarks and the loader use only this interface: `embed`, `layers`, `final_norm`, `compute_logits`,
`hidden_states`, `forward_cached`, `forward` and `checkpoint_layout`.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..cache.attention_metadata import AttentionMetadata
from ..cache.kv_cache import KVCache
from ..config import ModelConfig
from .layers import DecoderLayer, RMSNorm, Rotary, linear, rotary_cos_sin


def refuse_unsupported(cfg: dict, implemented: dict):
    """A config.json key whose value differs from the one the architecture implements is a one-line error."""
    for key, expected in implemented.items():
        if key in cfg and cfg[key] != expected:
            raise ValueError(f"config.json: {key}={cfg[key]!r} is not supported (expected {expected!r})")


class DiffusionLM(nn.Module):
    model_type: ClassVar[str]  # config.json's model_type
    logit_shift: ClassVar[int] = 0
    # The transformers tokenizer class that reads the checkpoint's vocab.json + merges.txt where it ships no
    # tokenizer.json (None: tokenizer.json only).
    vocab_merges_tokenizer: ClassVar[str | None] = None
    # Generic module -> checkpoint tensor prefix. Keys: "embed", "final_norm", "lm_head", "layer" (with {i}),
    # and per layer "attn_norm", "attention.qkv_proj", "attention.o_proj", "mlp_norm", "mlp.gate_up_proj",
    # "mlp.down_proj"; a packed projection maps to one name per shard.
    checkpoint_names: ClassVar[dict[str, str | tuple[str, ...]]]

    @classmethod
    def parse_config(cls, hf_config: dict) -> ModelConfig:
        raise NotImplementedError

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layer) for layer in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                      bias=cfg.linear_bias)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, ordered: bool = False,
                      kernels: bool = False) -> torch.Tensor:
        """input_ids [B, L] -> final-normed hidden states [B, L, d].

        positions [B, L] are the RoPE positions (default 0..L-1); attention_mask [B, L] is True for the
        keys a row may attend to (False for padding). ordered: attention sums over keys in one fixed order
        (batch-invariant decoding, kernels/attention.py); with `kernels`, every sum of the pass through the
        Triton kernels in one tiling (the GPU's way to the same property).
        """
        B, L = input_ids.shape
        if positions is None:
            positions = torch.arange(L, device=input_ids.device).expand(B, L)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        attn_mask = None if attention_mask is None else attention_mask[:, None, None, :]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask, ordered, kernels)
        invariant = ordered and kernels
        return self.final_norm(x, invariant, invariant)

    def forward_cached(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                       cache: KVCache, key_mass: torch.Tensor | None = None, kernels: bool = False) -> torch.Tensor:
        """Flat query rows input_ids, positions [N] -> final-normed hidden states [N, d].

        Each layer writes the rows' K/V into `cache` at metadata.slot_mapping, then every request's rows
        attend to its whole range of the cache (see AttentionMetadata). With key_mass [B, max_kv], the
        attention mass of the tracked rows is accumulated over layers and heads. `kernels`: the Triton
        kernels instead of their PyTorch references.
        """
        rope = Rotary.at(positions, self.config)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer.forward_cached(x, rope, metadata, cache, key_mass, kernels)
        return self.final_norm(x, kernels, metadata.ordered and kernels)

    def compute_logits(self, hidden: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """hidden [..., d] -> logits [..., V]; called only on the rows whose logits are used. invariant: through
        the batch-invariant GEMM."""
        head = self.embed if self.lm_head is None else self.lm_head
        return linear(hidden, head.weight, getattr(head, "bias", None), invariant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] -> logits [B, L, V] under full bidirectional attention; row i predicts position i
        (for a shifted architecture, row i comes from hidden state i - 1 and row 0 from hidden state 0)."""
        logits = self.compute_logits(self.hidden_states(input_ids, positions, attention_mask))
        if self.logit_shift:
            logits = torch.cat([logits[:, :self.logit_shift], logits[:, :-self.logit_shift]], dim=1)
        return logits

    def checkpoint_layout(self) -> dict[str, tuple[str, slice | None]]:
        """Checkpoint tensor name -> (parameter name, rows of that parameter it fills, or None for all)."""
        names = self.checkpoint_names
        layout: dict[str, tuple[str, slice | None]] = {}
        for param_name, _ in self.named_parameters():
            module_name, _, kind = param_name.rpartition(".")
            if module_name.startswith("layers."):
                _, index, inner = module_name.split(".", 2)
                prefix, target = names["layer"].format(i=index) + ".", names[inner]
            else:
                prefix, target = "", names[module_name]
            if isinstance(target, tuple):  # a packed projection (PackedLinear, or Fp8Linear with output_sizes)
                module = self.get_submodule(module_name)
                for shard, shard_name in enumerate(target):
                    layout[f"{prefix}{shard_name}.{kind}"] = (param_name, module.rows(shard))
            else:
                layout[f"{prefix}{target}.{kind}"] = (param_name, None)
        return layout
