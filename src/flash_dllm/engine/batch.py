"""The device state of the running batch: one left-padded row per sequence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams
from .sequence import Sequence


@dataclass
class DecodeBatch:
    seqs: list[Sequence]
    params: SamplingParams        # settings the rows share (equal batch_key)
    tokens: torch.Tensor          # [B, W] pad | prompt | generated or mask; every row ends at column W
    lengths: torch.Tensor         # [B] real tokens per row (prompt + generation)
    attention_mask: torch.Tensor  # [B, W] True on real (non-pad) tokens
    positions: torch.Tensor       # [B, W] RoPE positions, 0 at each row's first real token
    block_index: torch.Tensor     # [B] current block within the generated region
    step_in_block: torch.Tensor   # [B]
    steps: torch.Tensor           # [B] denoising steps so far (also the sampling noise counter)
    nfe: torch.Tensor             # [B] forward passes so far
    temperature: torch.Tensor     # [B]
    seed: torch.Tensor            # [B]
    rule_value: torch.Tensor      # [B] float64: confidence threshold or factor (parallel)
    is_sampling: bool             # some row has temperature > 0
    cache_base: torch.Tensor | None  # [B] first KV-cache row of each sequence (cached methods)
    position_state: dict[str, torch.Tensor]  # method state per position, [B, W] aligned with tokens
    # Methods whose query count varies (elastic): the next step's query rows per row, set on the device
    # by the step and read at the engine's one sync into host_query_rows, which the step's shapes use.
    next_query_rows: torch.Tensor | None = None  # [B]
    host_query_rows: list[int] | None = None

    @property
    def host_block_index(self) -> list[int]:
        return [seq.block_index for seq in self.seqs]

    @property
    def host_step_in_block(self) -> list[int]:
        return [seq.step_in_block for seq in self.seqs]

    def count_query_rows(self, counts: list[int]):
        """Record the query rows a pass computed for each sequence."""
        for seq, count in zip(self.seqs, counts):
            seq.query_rows += count

    @property
    def gen_start(self) -> int:
        return self.tokens.shape[1] - self.params.max_tokens

    @classmethod
    def build(cls, seqs: list[Sequence], pad_id: int, device: torch.device) -> DecodeBatch:
        """Stack the sequences' tokens and counters into padded batch tensors (on membership changes only)."""
        lengths = torch.tensor([seq.length for seq in seqs], device=device)
        width = max(seq.length for seq in seqs)
        tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
        position_state = {name: torch.zeros((len(seqs), width), dtype=value.dtype, device=device)
                          for name, value in seqs[0].position_state.items()}
        for row, seq in enumerate(seqs):
            tokens[row, width - seq.length:] = seq.tokens
            for name, value in seq.position_state.items():
                position_state[name][row, width - seq.length:] = value
        attention_mask = torch.arange(width, device=device) >= (width - lengths)[:, None]
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        block_index, step_in_block, steps, nfe = torch.stack([seq.counters for seq in seqs]).unbind(1)
        params = seqs[0].params
        rule = [s.params.factor if s.params.factor is not None else s.params.confidence_threshold for s in seqs]
        return cls(
            seqs=seqs, params=params, tokens=tokens, lengths=lengths, attention_mask=attention_mask, positions=positions,
            block_index=block_index, step_in_block=step_in_block, steps=steps, nfe=nfe,
            temperature=torch.tensor([s.params.temperature for s in seqs], device=device),
            seed=torch.tensor([s.params.seed for s in seqs], device=device),
            rule_value=torch.tensor(rule, dtype=torch.float64, device=device),
            is_sampling=any(s.params.temperature > 0 for s in seqs),
            cache_base=torch.tensor([s.cache_base for s in seqs], device=device) if params.uses_cache else None,
            position_state=position_state,
        )

    def unpack(self):
        """Hand each row's state back to its sequence before the batch is rebuilt."""
        counters = torch.stack([self.block_index, self.step_in_block, self.steps, self.nfe], dim=1)
        width = self.tokens.shape[1]
        for row, seq in enumerate(self.seqs):
            if seq.is_finished:
                continue
            seq.tokens = self.tokens[row, width - seq.length:].clone()
            seq.counters = counters[row].clone()
            seq.position_state = {name: value[row, width - seq.length:].clone()
                                  for name, value in self.position_state.items()}
