"""What an architecture is to the engine: `DiffusionLM`, a stack of pre-norm decoder layers between a
token embedding and an LM head, with the attention pattern its config declares (ModelConfig.attention).

An architecture subclasses it with `model_type` and `architectures` (config.json's, by which the loader finds it),
`parse_config` (its config.json -> ModelConfig), `checkpoint_names` (its tensor names for the generic modules),
`logit_shift` (0: row i of the logits predicts position i; 1: row i comes from hidden state i - 1, as in Dream) and,
where its layers' feed-forward blocks differ from the gated MLP, `feed_forward`. The engine, the decoding methods,
the benchmarks and the loader use only this interface: `embed`, `layers`, `final_norm`, `compute_logits`,
`hidden_states`, `forward_cached`, `forward` and `checkpoint_layout`.
"""
from __future__ import annotations

import itertools
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from ..cache.attention_metadata import AttentionMetadata
from ..cache.kv_cache import KVCache
from ..config import ModelConfig
from .layers import DecoderLayer, GatedMLP, RMSNorm, Rotary, linear, rotary_cos_sin
from .parallel import TensorParallel, VocabParallelEmbedding, shard_config


class Shard(NamedTuple):
    """The part of a checkpoint tensor that one tensor-parallel rank loads: [start, stop) along `dim`, of the
    tensor's `size` entries along it."""
    dim: int
    start: int
    stop: int
    size: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.stop - self.start)


class Pieces(NamedTuple):
    """Several parts of one checkpoint tensor along one dim, concatenated: a rank's part of a fused projection (its
    query, key and value heads of one q|k|v matrix)."""
    parts: tuple[Shard, ...]

    @property
    def dim(self) -> int:
        return self.parts[0].dim

    @property
    def size(self) -> int:
        return self.parts[0].size

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.of(tensor) for part in self.parts], dim=self.dim)


# A Placement's shard for a checkpoint tensor that another rank holds whole (expert parallelism's other experts):
# this rank checks its shape and reads none of it.
ELSEWHERE = "elsewhere"


class Placement(NamedTuple):
    """Where a checkpoint tensor goes: the parameter, the index of its part that the tensor fills (rows, or one
    expert's rows of a stack; None: all), and the part of the tensor this rank loads (None: all of it)."""
    param: str
    rows: slice | tuple | None
    shard: Shard | Pieces | None = None


def refuse_unsupported(cfg: dict, implemented: dict):
    """A config.json key whose value differs from the one the architecture implements is a one-line error."""
    for key, expected in implemented.items():
        if key in cfg and cfg[key] != expected:
            raise ValueError(f"config.json: {key}={cfg[key]!r} is not supported (expected {expected!r})")


def required_ints(cfg: dict, *keys: str) -> tuple[int, ...]:
    """config.json's values of `keys` as ints; a missing or null one is a one-line error naming it."""
    for key in keys:
        if key not in cfg:
            raise ValueError(f"config.json: missing required key {key!r}")
        if cfg[key] is None:
            raise ValueError(f"config.json: a required key is null: {key!r}")
    return tuple(int(cfg[key]) for key in keys)


class DiffusionLM(nn.Module):
    model_type: ClassVar[str]  # config.json's model_type
    # config.json's `architectures` names this class implements, which tell it apart from others of its model_type;
    # the first is its name in ARCHITECTURES and ModelConfig.architecture.
    architectures: ClassVar[tuple[str, ...]]
    logit_shift: ClassVar[int] = 0
    # The transformers tokenizer class that reads the checkpoint's vocab.json + merges.txt where it ships no
    # tokenizer.json (None: tokenizer.json only).
    vocab_merges_tokenizer: ClassVar[str | None] = None
    # Generic module -> checkpoint tensor prefix. Keys: "embed", "final_norm", "lm_head", "layer" (with {i}),
    # and per layer "attn_norm", "attention.qkv_proj" (and "attention.q_norm", "attention.k_norm" with qk_norm),
    # "attention.o_proj", "mlp_norm", and each module of the layer's feed-forward block under "mlp."
    # ("mlp.gate_up_proj", "mlp.down_proj" for the gated MLP); a packed projection maps to one name per matrix, or
    # to one name where the checkpoint keeps them fused. A module that names its own tensors
    # (`checkpoint_placements`, as models/moe.py's experts) maps to its prefix.
    checkpoint_names: ClassVar[dict[str, str | tuple[str, ...]]]

    @classmethod
    def parse_config(cls, hf_config: dict) -> ModelConfig:
        raise NotImplementedError

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        """tp: this rank's place in a tensor-parallel group (models/parallel.py; default: one rank). `config` stays
        the whole model's; `shard_config` has the shapes of this rank's decoder layers and KV cache."""
        super().__init__()
        self.config, self.tp = cfg, tp or TensorParallel()
        self.shard_config = shard_config(cfg, self.tp)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.layers = nn.ModuleList(DecoderLayer(self.shard_config, layer, self.tp, self.feed_forward(layer))
                                    for layer in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.embed.num_embeddings,
                                                                      bias=cfg.linear_bias)

    def feed_forward(self, layer: int) -> nn.Module:
        """The feed-forward block of decoder layer `layer` (the gated MLP by default; a mixture of experts, or a
        dense first layer, is an architecture's own): ffn(x [..., d], kernels, invariant) -> [..., d], over the
        normed hidden states. Built from self.shard_config and self.tp, before the layers exist."""
        return GatedMLP(self.shard_config, self.tp)

    def visible_keys(self, positions: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """positions [B, L], attention_mask [B, L] (True: a real token) -> [B, 1, 1 or L, L] True where query row i
        may attend to key j under the model's attention pattern (None: every key). Block-causal: key j's block at
        most query i's (a left-padded row's pads sit at position 0, so every row sees a key)."""
        keys = None if attention_mask is None else attention_mask[:, None, None, :]
        pattern = self.config.attention
        if pattern.kind == "bidirectional":
            return keys
        block = positions.clamp(min=0) // pattern.block_size
        visible = (block[:, None, :] <= block[:, :, None])[:, None]
        return visible if keys is None else visible & keys

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, ordered: bool = False,
                      kernels: bool = False) -> torch.Tensor:
        """input_ids [B, L] -> final-normed hidden states [B, L, d].

        positions [B, L] are the RoPE positions (default 0..L-1), which also place the attention pattern's blocks;
        attention_mask [B, L] is True for the keys a row may attend to (False for padding). ordered: attention sums
        over keys in one fixed order (batch-invariant decoding, kernels/attention.py); with `kernels`, every sum of
        the pass through the Triton kernels in one tiling (the GPU's way to the same property).
        """
        B, L = input_ids.shape
        if positions is None:
            positions = torch.arange(L, device=input_ids.device).expand(B, L)
        cos, sin = rotary_cos_sin(positions, self.config.rotary_width, self.config.rope_theta)
        attn_mask = self.visible_keys(positions, attention_mask)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask, ordered, kernels)
        invariant = ordered and kernels
        return self.final_norm(x, invariant, invariant)

    def forward_cached(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                       cache: KVCache, key_mass: torch.Tensor | None = None, kernels: bool = False) -> torch.Tensor:
        """Flat query rows input_ids, positions [N] -> final-normed hidden states [N, d].

        Each layer writes the rows' K/V into `cache` at metadata.slot_mapping, then every request's rows
        attend to its whole range of the cache (see AttentionMetadata): bidirectional attention, whatever the
        model's pattern (the engine runs a block-causal model's requests only with the methods that declare it,
        DecodingMethod.attention_patterns). With key_mass [B, max_kv], the attention mass of the tracked rows is
        accumulated over layers and heads. `kernels`: the Triton kernels instead of their PyTorch references.
        """
        rope = Rotary.at(positions, self.config)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer.forward_cached(x, rope, metadata, cache, key_mass, kernels)
        return self.final_norm(x, kernels, metadata.ordered and kernels)

    def compute_logits(self, hidden: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """hidden [..., d] -> logits [..., V]; called only on the rows whose logits are used. invariant: through
        the batch-invariant GEMM. Under tensor parallelism each rank computes its vocabulary rows' logits, gathered
        over the ranks."""
        head = self.embed if self.lm_head is None else self.lm_head
        return self.tp.all_gather(linear(hidden, head.weight, getattr(head, "bias", None), invariant), dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] -> logits [B, L, V] under the model's attention pattern; row i predicts position i
        (for a shifted architecture, row i comes from hidden state i - 1 and row 0 from hidden state 0)."""
        logits = self.compute_logits(self.hidden_states(input_ids, positions, attention_mask))
        if self.logit_shift:
            logits = torch.cat([logits[:, :self.logit_shift], logits[:, :-self.logit_shift]], dim=1)
        return logits

    def checkpoint_layout(self) -> dict[str, Placement]:
        """Checkpoint tensor name -> its Placement: the parameter it fills, which rows, and under tensor parallelism
        which part of the tensor this rank holds."""
        names = self.checkpoint_names
        layout: dict[str, Placement] = {}
        for param_name, _ in self.named_parameters():
            module_name, _, kind = param_name.rpartition(".")
            if module_name.startswith("layers."):
                _, index, inner = module_name.split(".", 2)
                prefix, target = names["layer"].format(i=index) + ".", names[inner]
            else:
                prefix, inner, target = "", module_name, names[module_name]
            module = self.get_submodule(module_name)
            if hasattr(module, "checkpoint_placements"):  # it maps its own tensors (stacked experts)
                for name, (index, shard) in module.checkpoint_placements(kind).items():
                    layout[f"{prefix}{target}.{name}"] = Placement(param_name, index or None, shard)
            elif isinstance(target, tuple):  # a packed projection (PackedLinear, or Fp8Linear with output_sizes)
                for shard, shard_name in enumerate(target):
                    layout[f"{prefix}{shard_name}.{kind}"] = Placement(param_name, module.rows(shard),
                                                                       self._shard(inner, kind, module, shard))
            elif len(getattr(module, "output_sizes", ())) > 1:  # a packed projection stored fused
                parts = [self._shard(inner, kind, module, shard) for shard in range(len(module.output_sizes))]
                fused = None if parts[0] is None else Pieces(tuple(
                    Shard(0, part.start + offset, part.stop + offset, sum(p.size for p in parts))
                    for part, offset in zip(parts, itertools.accumulate([0] + [p.size for p in parts[:-1]]))))
                layout[f"{prefix}{target}.{kind}"] = Placement(param_name, None, fused)
            else:
                layout[f"{prefix}{target}.{kind}"] = Placement(param_name, None, self._shard(inner, kind, module))
        return layout

    def _shard(self, module: str, kind: str, layer_module: nn.Module, packed: int = 0) -> Shard | None:
        """This rank's part of a checkpoint tensor of the generic module `module` (layer_module: the module itself,
        whose widths are the rank's; `packed`: which of a packed projection's matrices), or None where every rank
        holds all of it."""
        tp, cfg = self.tp, self.config
        if tp.size == 1:
            return None
        q_size, kv_size, head_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        if module in ("embed", "lm_head"):
            vocab = tp.part(cfg.vocab_size)
            return Shard(0, vocab.start, vocab.stop, cfg.vocab_size)
        if module == "attention.qkv_proj":
            heads = tp.part(cfg.num_heads) if packed == 0 else tp.kv_heads(cfg.num_kv_heads)
            return Shard(0, heads.start * head_dim, heads.stop * head_dim, q_size if packed == 0 else kv_size)
        if module.endswith("gate_up_proj"):  # the gated MLP's, or a shared expert's, column-parallel features
            size = layer_module.output_sizes[0] * tp.size
            features = tp.part(size)
            return Shard(0, features.start, features.stop, size)
        if kind == "weight" and (module == "attention.o_proj" or module.endswith("down_proj")):  # row-parallel
            size = q_size if module == "attention.o_proj" else layer_module.in_features * tp.size
            features = tp.part(size)
            return Shard(1, features.start, features.stop, size)
        return None  # the norms, and the row-parallel biases (added once, after the sum)
