"""The running batch as the decoding methods see it: one left-padded row per sequence, on the device, with
the host values a step's shapes need. It sits below engine/ (which builds it) and decoding/ (which steps it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .sampling_params import SamplingParams


@dataclass
class Counters:
    """A sequence's progress, one tensor each: [B] in a batch, 0-d for a sequence outside one."""

    block_index: torch.Tensor    # current block within the generated region (blocks completed)
    step_in_block: torch.Tensor
    steps: torch.Tensor          # denoising steps so far (also the sampling noise counter)
    nfe: torch.Tensor            # forward passes so far
    prompt_keys_read: torch.Tensor   # routed prompt keys read, over passes, layers and KV heads (cache/routing.py)
    prompt_keys_dense: torch.Tensor  # the same had every prompt key been read
    mask_free_steps: torch.Tensor    # Draft-and-Edit: forwards of the current block that began without a mask

    @classmethod
    def zeros(cls, device) -> Counters:
        return cls(*(torch.zeros((), dtype=torch.long, device=device) for _ in dataclasses.fields(cls)))

    @classmethod
    def stack(cls, rows: list[Counters]) -> Counters:
        return cls(*(torch.stack([getattr(r, f.name) for r in rows]) for f in dataclasses.fields(cls)))

    def row(self, index: int) -> Counters:
        return Counters(*(getattr(self, f.name)[index].clone() for f in dataclasses.fields(self)))


@dataclass(eq=False)
class RowState:
    """One sequence's decoding state, kept between batches: the batch reads it when it is built, writes it
    back before it is rebuilt, and updates its host values (block phase, query rows) as it steps."""

    params: SamplingParams
    prompt_length: int
    tokens: torch.Tensor        # [P + G] prompt, then generated or mask ids
    counters: Counters
    state: Any                  # the method's per-position state ([P + G] tensors), or None
    cache_base: int | None      # first row of the sequence's range in the KV cache (cached methods)
    block_index: int = 0        # host copies of the block phase, refreshed at the engine's one sync per step
    step_in_block: int = 0
    query_rows: int = 0         # query rows computed over all forward passes so far
    next_query_rows: int | None = None  # methods whose query count varies: the next step's (from the device)
    clustered: bool = False     # its routed prompt's k-means regions exist in the cache (cache/routing.py)

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    @property
    def tail(self) -> int:
        """Positions after the generation (DecodingMethod.tail_tokens), the same for every row of a batch."""
        return self.length - self.prompt_length - self.params.max_tokens

    @property
    def is_first_pass(self) -> bool:
        return self.query_rows == 0


def _stack_padded(values: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    """[L_b] tensors -> [B, width], each row right-aligned (left padding with `fill`)."""
    out = torch.full((len(values), width), fill, dtype=values[0].dtype, device=values[0].device)
    for row, value in enumerate(values):
        out[row, width - value.shape[0]:] = value
    return out


@dataclass
class DecodeBatch:
    rows: list[RowState]
    params: SamplingParams        # settings the rows share (equal batch_key)
    mask_id: int
    stop_ids: torch.Tensor        # [S] the tokens that end an output (eos, eot)
    tokens: torch.Tensor          # [B, W] pad | prompt | generated or mask; every row ends at column W
    lengths: torch.Tensor         # [B] real tokens per row (prompt + generation)
    attention_mask: torch.Tensor  # [B, W] True on real (non-pad) tokens
    positions: torch.Tensor       # [B, W] RoPE positions, 0 at each row's first real token
    counters: Counters            # [B] each
    temperature: torch.Tensor     # [B]
    seed: torch.Tensor            # [B]
    rule_value: torch.Tensor      # [B] float64: the unmasking rule's per-row value (threshold or factor)
    is_sampling: bool             # some row has temperature > 0
    cache_base: torch.Tensor | None  # [B] first KV-cache row of each sequence (cached methods)
    state: Any                    # the method's per-position state, [B, W] tensors aligned with tokens
    next_query_rows: torch.Tensor | None = None  # [B] set by a step whose next query counts vary
    number: int = 0  # its number on the runner (0: none): graphs that read and write its tensors replay only over it

    @property
    def gen_start(self) -> int:
        """The first generated column (the generation, then any tail its method decodes: every row ends at W)."""
        return self.tokens.shape[1] - self.params.max_tokens - self.rows[0].tail


    def frozen_prompt(self, constant) -> torch.Tensor | None:
        """[B, W] bool: the prompt columns of the rows whose prompt KV is routed, frozen between full passes (no
        step recomputes them: cache/routing.py); None where no row routes (a dense batch's step does no work for
        it). `constant`: the runner's host list -> device tensor."""
        routed = [row.params.routes_prompt for row in self.rows]
        if not any(routed):
            return None
        columns = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return constant(routed).bool()[:, None] & (columns < self.gen_start)

    def count_query_rows(self, counts: list[int]):
        """Record the query rows a pass computed for each row."""
        for row, count in zip(self.rows, counts):
            row.query_rows += count

    @classmethod
    def build(cls, rows: list[RowState], mask_id: int, stop_ids: torch.Tensor, pad_id: int, number: int = 0
              ) -> DecodeBatch:
        """Stack the rows' tokens, counters and state into padded batch tensors (on membership changes only)."""
        device = rows[0].tokens.device
        lengths = torch.tensor([row.length for row in rows], device=device)
        width = max(row.length for row in rows)
        attention_mask = torch.arange(width, device=device) >= (width - lengths)[:, None]
        state = rows[0].state
        if state is not None:
            state = type(state)(**{f.name: _stack_padded([getattr(row.state, f.name) for row in rows], width, 0)
                                   for f in dataclasses.fields(state)})
        params = rows[0].params
        return cls(
            rows=rows, params=params, mask_id=mask_id, stop_ids=stop_ids,
            tokens=_stack_padded([row.tokens for row in rows], width, pad_id), lengths=lengths,
            attention_mask=attention_mask, positions=(attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            counters=Counters.stack([row.counters for row in rows]),
            temperature=torch.tensor([row.params.temperature for row in rows], device=device),
            seed=torch.tensor([row.params.seed for row in rows], device=device),
            rule_value=torch.tensor([row.params.settings.rule_value for row in rows],
                                    dtype=torch.float64, device=device),
            is_sampling=any(row.params.temperature > 0 for row in rows),
            cache_base=(torch.tensor([row.cache_base for row in rows], device=device)
                        if rows[0].cache_base is not None else None),
            state=state, number=number,
        )

    def unpack(self, keep: list[bool]):
        """Hand each kept row's state back to its RowState before the batch is rebuilt."""
        width = self.tokens.shape[1]
        for index, (row, kept) in enumerate(zip(self.rows, keep)):
            if not kept:
                continue
            start = width - row.length
            row.tokens = self.tokens[index, start:].clone()
            row.counters = self.counters.row(index)
            if self.state is not None:
                row.state = type(self.state)(**{f.name: getattr(self.state, f.name)[index, start:].clone()
                                                for f in dataclasses.fields(self.state)})
