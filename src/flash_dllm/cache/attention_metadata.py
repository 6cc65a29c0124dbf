"""One cached pass's attention schedule: which query rows belong to which request, where each row's K/V
goes in the cache and which cache rows each request attends to."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .routing import PromptRouting


def padded_index(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] starts and lengths -> row index [B, width] (clamped in range) and validity [B, width]: a pass's rows
    or cache keys per request, padded to the widest."""
    offsets = torch.arange(width, device=starts.device)
    valid = offsets < lengths[:, None]
    return torch.where(valid, starts[:, None] + offsets, starts[:, None]), valid


def device_tensor(values: list[int], device) -> torch.Tensor:
    """A short host list of ints on the device without waiting for the GPU: a plain copy synchronises the
    stream, a non-blocking one from pageable memory is staged at once and queued."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def cu_seqlens(counts: list[int], device) -> torch.Tensor:
    """Per-request row counts -> offsets [B + 1] of each request's rows in the flat order."""
    return device_tensor([0, *itertools.accumulate(counts)], device)


@dataclass
class FlatRows:
    """A pass's query rows, flat and grouped by request, from per-request row counts known on the host:
    each row's request and rank within it, gathered without a host sync (boolean indexing would wait for
    the GPU)."""

    counts: list[int]
    cu_seqlens: torch.Tensor  # [B + 1]
    request: torch.Tensor     # [N]
    rank: torch.Tensor        # [N]

    @classmethod
    def from_counts(cls, counts: list[int], device, upload=None) -> FlatRows:
        """upload(values) -> the host list on the device (the runner's keeps repeated lists there for CUDA
        graphs); default: a fresh copy."""
        offsets = [0, *itertools.accumulate(counts)]
        cu = upload(offsets) if upload is not None else device_tensor(offsets, device)
        num_rows = offsets[-1]
        request = torch.repeat_interleave(torch.arange(len(counts), device=device), cu.diff(), output_size=num_rows)
        return cls(counts, cu, request, torch.arange(num_rows, device=device) - cu[request])

    @property
    def num_rows(self) -> int:
        return sum(self.counts)


@dataclass
class AttentionMetadata:
    """Query rows are flat [N], grouped by request: group b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
    Every query row first writes its K/V to cache row slot_mapping[row]; then group b attends to cache
    rows [kv_start[b], kv_start[b] + kv_len[b]) (its whole sequence, bidirectionally).

    track_rows [N] bool (optional): rows whose softmax attention mass per key is accumulated (the masked
    queries of Flash-Cache's tracking), into a [B, max_kv] buffer indexed by key offset.

    A pass with write_cache=False (Flash-Verify's verify pass) leaves the cache untouched: its rows attend
    to the cache range minus `hidden_keys` [B, max_kv] (positions the pass recomputes) and to the pass's
    own rows as `self_visibility` [B, max_q, max_q] allows (query row i sees pass row j), both in each
    request's padded row order.

    ordered: every sum over keys in one fixed order (batch-invariant decoding).

    routing (optional): the requests whose prompt keys are routed (cache/routing.py): each layer opens, per
    request and KV head, only the prompt's chunks that the pass's queries may need.
    """

    cu_seqlens_q: torch.Tensor  # [B + 1]
    kv_start: torch.Tensor      # [B]
    kv_len: torch.Tensor        # [B]
    slot_mapping: torch.Tensor  # [N]
    max_q: int
    max_kv: int
    track_rows: torch.Tensor | None = None
    write_cache: bool = True
    hidden_keys: torch.Tensor | None = None
    self_visibility: torch.Tensor | None = None
    ordered: bool = False
    routing: PromptRouting | None = None

    @property
    def num_seqs(self) -> int:
        return self.kv_start.shape[0]

    def requests(self, group: slice, rows: slice, max_q: int) -> AttentionMetadata:
        """The metadata of the requests `group` alone, which own the flat query rows `rows` (at most max_q each):
        one part of a pass run in parts. Not for a routed pass (its routing holds every request's state)."""
        assert self.routing is None, "a routed pass runs whole"
        part = lambda t, index: None if t is None else t[index]
        return dataclasses.replace(
            self, cu_seqlens_q=self.cu_seqlens_q[group.start:group.stop + 1] - rows.start,
            kv_start=self.kv_start[group], kv_len=self.kv_len[group], slot_mapping=self.slot_mapping[rows],
            max_q=max_q, track_rows=part(self.track_rows, rows), hidden_keys=part(self.hidden_keys, group),
            self_visibility=part(self.self_visibility, group))

    @classmethod
    def build(cls, rows: FlatRows, kv_start: torch.Tensor, kv_len: torch.Tensor, positions: torch.Tensor,
              max_kv: int, **options) -> AttentionMetadata:
        """Request b's rows attend to its kv_len[b] cache rows from kv_start[b]; each row's K/V slot is
        kv_start + its position [N]. `options`: track_rows, write_cache, hidden_keys, self_visibility, ordered,
        routing."""
        return cls(cu_seqlens_q=rows.cu_seqlens, kv_start=kv_start, kv_len=kv_len,
                   slot_mapping=kv_start[rows.request] + positions, max_q=max(rows.counts), max_kv=max_kv,
                   **options)
