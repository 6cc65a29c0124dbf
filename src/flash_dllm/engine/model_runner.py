"""The model runner: everything that executes on the device for a decoding step.

It owns the model, the KV cache, the kernel and CUDA-graph switches, and builds each cached pass's
attention metadata from per-request row counts. The decoding methods ask it for hidden states of a set of
query rows (`prepare` + `run`, or a full forward) and for the logits of a set of columns (`full_logits`,
`logit_rows` + `logits`): the only places that know how an architecture's logits line up with positions
(`logit_shift`).
"""
from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..batch import DecodeBatch
from ..cache.attention_metadata import AttentionMetadata, FlatRows, device_tensor
from ..cache.kv_cache import KVCache
from ..cache.routing import PromptRouting
from ..decoding.base import check, check_type
from ..models.base import DiffusionLM
from ..models.loader import available_memory
from ..models.quantization import Fp8Linear, check_options, kv_dtype_of
from .cuda_graphs import MAX_GRAPH_ROWS, CudaGraphs, bucket
from .warmup import compile_kernels


@dataclass
class CachedPass:
    """The flat query rows of one cached pass, grouped by request: flat row i belongs to batch row request[i]
    (the groups follow the batch's rows, or the order the pass was prepared with)."""

    rows: FlatRows
    request: torch.Tensor    # [N] batch row of each flat row
    column: torch.Tensor     # [N] its column in the batch
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] its position in the sequence (RoPE, cache slot offset)
    metadata: AttentionMetadata
    batch_shape: tuple[int, int]

    @functools.cached_property
    def flat_of_column(self) -> torch.Tensor:
        """[B, W]: the flat row of each (batch row, column) of the pass; -1 where the pass has none."""
        flat = torch.full(self.batch_shape, -1, dtype=torch.long, device=self.column.device)
        flat[self.request, self.column] = torch.arange(self.column.shape[0], device=self.column.device)
        return flat


# A full forward over more rows runs in groups of whole sequences: its activations (above all the attention's fp32
# rotations of q and k, ~150 KB a row at LLaDA-8B's shapes) would otherwise grow with the batch (H200, batch 32 x 768
# positions: 3.3 GB beyond weights and cache in one forward, 1.2-1.4 GB in groups). A group of this many rows is
# FLOP-bound, so reading the weights once per group costs ~2% of its time.
FULL_PASS_ROWS = 8192


def sequence_groups(batch_size: int, width: int) -> list[slice]:
    """The batch rows of a full forward's groups: as many whole sequences as fit FULL_PASS_ROWS (at least one)."""
    per_group = max(1, FULL_PASS_ROWS // width)
    return [slice(start, start + per_group) for start in range(0, batch_size, per_group)]


def request_groups(counts: list[int]) -> list[slice]:
    """The requests of a cached pass's parts, from their query rows: consecutive requests whose rows together fit
    FULL_PASS_ROWS (at least one request a part)."""
    groups, start, rows = [], 0, 0
    for index, count in enumerate(counts):
        if index > start and rows + count > FULL_PASS_ROWS:
            groups.append(slice(start, index))
            start, rows = index, 0
        rows += count
    return [*groups, slice(start, len(counts))]


def default_cache_budget(device: torch.device) -> int:
    """The KV cache's bytes where kv_cache_bytes is not given: 40% of the device's free memory (on the CPU, of
    MemAvailable, at most 1 GiB: its memory also holds everything else)."""
    available = available_memory(device)
    budget = int(0.4 * available) if available is not None else 1 << 30
    return budget if device.type == "cuda" else min(budget, 1 << 30)


class ModelRunner:
    """kernels: the cached passes through the Triton kernels (default: on CUDA; TRITON_INTERPRET=1 runs them
    on the CPU); False uses their PyTorch references (same tokens). cuda_graphs: replay the cached passes
    whose shapes repeat from CUDA graphs (default: with the kernels on CUDA). kv_cache_bytes: the cache's
    budget, at least one token's row and at most the device's free memory (default: 40% of free GPU memory, or on
    the CPU 40% of MemAvailable up to 1 GiB; under tensor parallelism per rank, the least rank's default); allocated
    at the first request that needs it, when the kernels are also compiled. batch_invariant: every request's tokens the same alone or in any batch: every sum in one order
    (kernels/attention.py's ordered sums on the PyTorch path, which relies on the CPU's GEMMs giving a row the
    same result for any row count; on the kernel path, the GPU's, the batch-invariant GEMM and one tiling of
    every kernel)."""

    def __init__(self, model: DiffusionLM, kernels: bool | None = None, cuda_graphs: bool | None = None,
                 kv_cache_bytes: int | None = None, batch_invariant: bool = False, kv_cache_dtype: str | None = None):
        weights = next(model.parameters())
        self.model, self.device, self.dtype = model, weights.device, weights.dtype
        on_cuda = self.device.type == "cuda"
        if kernels and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels=True needs a CUDA device (or TRITON_INTERPRET=1 to run them interpreted)")
        self.kernels = on_cuda if kernels is None else kernels
        if batch_invariant and on_cuda and not self.kernels:
            raise ValueError("batch_invariant=True on a GPU runs through the Triton kernels: with kernels=False "
                             "cuBLAS and PyTorch's reductions choose their order by the batch's shape")
        quantized = any(isinstance(module, Fp8Linear) for module in model.modules())
        check_options("fp8" if quantized else None, kv_cache_dtype, batch_invariant)
        self.kv_cache_dtype = kv_cache_dtype
        capability = torch.cuda.get_device_capability(self.device) if on_cuda else None
        if self.kv_dtype is not None and on_cuda and capability < (8, 9):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU with FP8 support (compute capability "
                             f"8.9 or later: Ada, Hopper); {torch.cuda.get_device_name(self.device)} has "
                             f"{'.'.join(map(str, capability))}")
        self.batch_invariant = batch_invariant
        self.invariant_gemms = batch_invariant and self.kernels  # the GEMMs through kernels/invariant_matmul.py
        if cuda_graphs and not (self.kernels and on_cuda):
            raise ValueError("cuda_graphs=True needs the Triton kernels on a CUDA device")
        # Off by default under tensor parallelism: capturing NCCL's collectives is untested here (cuda_graphs=True
        # captures them, every rank at the same sighting).
        default_graphs = self.kernels and on_cuda and model.tp.size == 1
        self.cuda_graphs = default_graphs if cuda_graphs is None else cuda_graphs
        check_type("kv_cache_bytes", kv_cache_bytes, "int | None")
        if kv_cache_bytes is not None:
            per_row = KVCache.bytes_per_row(model.shard_config, self.dtype, kv_dtype=self.kv_dtype)
            dtype = str(self.kv_dtype or self.dtype).removeprefix("torch.")
            check(kv_cache_bytes >= per_row, f"kv_cache_bytes must hold at least one token's row of the KV cache, "
                                             f"{per_row:,} bytes for this model in {dtype}, got {kv_cache_bytes:,}")
            free = available_memory(self.device)
            if free is not None:  # refused now, not at the first request's allocation (or the OOM killer)
                what = "free GPU memory" if self.device.type == "cuda" else "MemAvailable"
                check(kv_cache_bytes <= free, f"kv_cache_bytes does not fit this machine: the KV cache needs "
                                              f"{kv_cache_bytes:,} bytes and {self.device} has {free:,} bytes ({what})")
        self.kv_cache_bytes = kv_cache_bytes
        self.cache: KVCache | None = None
        self.graphs: CudaGraphs | None = None
        self.batch_numbers = itertools.count(1)  # every engine's batches on this runner (keys of graphs over them)
        self.logits_checked = False

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The KV cache's K/V dtype (None: the model's)."""
        return kv_dtype_of(self.kv_cache_dtype)

    @property
    def logit_shift(self) -> int:
        return self.model.logit_shift

    def allocate_cache(self, with_hidden: bool) -> KVCache:
        """The KV cache, allocated at the first call. If that call asks for the per-layer hidden states, the
        budget holds them too; a later call adds them beyond the budget."""
        if self.cache is not None:
            return self.cache
        budget = self.kv_cache_bytes
        if budget is None:  # under tensor parallelism, what every rank can hold: their caches have the same rows
            budget = self.model.tp.min(default_cache_budget(self.device), self.device)
        self.cache = KVCache.from_budget(self.model.shard_config, budget, self.dtype, self.device,
                                         with_hidden=with_hidden, kv_dtype=self.kv_dtype)
        if self.kernels and self.device.type == "cuda":
            compile_kernels(self.model, self.cache, ordered=self.batch_invariant)
        if self.cuda_graphs:
            self.graphs = CudaGraphs(self._forward_cached, self.device)
        return self.cache

    # Full passes: every position of every row.

    def full_logits(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                    columns: torch.Tensor) -> torch.Tensor:
        """One forward over tokens [B, W] (left-padded rows) -> fp32 logits [B, n] of the columns [B, n]."""
        batch_size, logits = tokens.shape[0], None
        for g, part in self.full_logits_in_groups(tokens, positions, attention_mask, columns):
            if g.stop >= batch_size and logits is None:  # one group
                return part
            if logits is None:  # written in place: a concatenation would hold every group's logits twice
                logits = part.new_empty(batch_size, *part.shape[1:])
            logits[g] = part
        return logits

    def full_logits_in_groups(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                              columns: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """full_logits group by group of sequences (`sequence_groups`): (the group's batch rows, their logits), for
        a reader that needs no more than a group's logits at a time."""
        for g in sequence_groups(*tokens.shape):
            yield g, self.logits_at(self._full_pass(tokens[g], positions[g], attention_mask[g]), columns[g])

    def full_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One forward over tokens [B, W] (left-padded rows) -> final-normed hidden states [B, W, d], run group by
        group of sequences (`sequence_groups`)."""
        parts = [self._full_pass(tokens[g], positions[g], attention_mask[g]) for g in sequence_groups(*tokens.shape)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _full_pass(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """full_hidden of one group. Batch invariant: each row runs with its own tokens first and attention sums
        keys in one order (kernels/attention.py), so that a row's keys are summed the same way whatever the
        batch's width."""
        if not self.batch_invariant:
            return self.model.hidden_states(tokens, positions, attention_mask)
        width = tokens.shape[1]
        padding = (~attention_mask).sum(dim=1, keepdim=True)
        columns = torch.arange(width, device=tokens.device)
        rolled = (columns + padding) % width  # rolled column c holds column (c + padding) % W
        hidden = self.model.hidden_states(tokens.gather(1, rolled), positions.gather(1, rolled),
                                          attention_mask.gather(1, rolled), ordered=True, kernels=self.kernels)
        back = ((columns - padding) % width)[..., None].expand(-1, -1, hidden.shape[-1])
        return hidden.gather(1, back)

    def logits_at(self, hidden: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, n] of the columns [B, n] from a full forward's final-normed hidden states [B, W, d]
        (`model.hidden_states`): a method that needs many columns' logits takes them in chunks."""
        source = self._logit_source(columns)[..., None].expand(-1, -1, hidden.shape[-1])
        return self._checked(self.model.compute_logits(hidden.gather(1, source), self.invariant_gemms).float())

    # Cached passes: a set of query rows per request, the rest of each sequence read from the KV cache.

    def prepare(self, batch: DecodeBatch, counts: list[int], columns: torch.Tensor, order: list[int] | None = None,
                track: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                visibility: torch.Tensor | None = None, kept: list[int] | None = None,
                block_size: int | None = None) -> CachedPass:
        """A pass over counts[g] query rows for batch row order[g] (default: g), its columns the first
        counts[g] of columns[g] [G, >= max(counts)]. track [B, W]: the columns whose attention mass the pass
        accumulates. input_ids [G, >= max(counts)]: the rows' tokens, where they are not the batch's.
        visibility [G, max_q, max_q]: a pass that does not write the cache, whose rows see each other as it
        says and none of their own positions in the cache (Flash-Verify's verify pass). kept [G]: the first kept[g]
        rows of group g are computed (they attend like the others, to the cache as it holds their own
        positions) but their K/V go to the cache's scratch row, so the cache keeps what it holds there (the
        left neighbours that a shifted architecture's logits need, recomputed for their hidden states only).
        block_size: each group is one block of a block-causal model, whose rows attend to the keys up to its end
        (every earlier block and itself), not to the row's whole range."""
        device, width = batch.tokens.device, batch.tokens.shape[1]
        rows = FlatRows.from_counts(counts, device, self.constant)
        groups = list(range(len(counts))) if order is None else order  # each group's batch row
        routed = any(batch.rows[b].params.kv_routing for b in groups)
        if order is None:
            request, kv_start, kv_len = rows.request, batch.cache_base, batch.lengths
        else:
            order_t = self.constant(order)
            request, kv_start, kv_len = order_t[rows.request], batch.cache_base[order_t], batch.lengths[order_t]
        # The keys' width, rounded up to a bucket of at most 1/8 more (not for a routed pass, whose chunk
        # bookkeeping spans it): what a pass's launches and graph depend on is then shared by the requests of
        # nearby lengths, so that a graph captured before ready serves them. Keys past a request's kv_len are
        # never read, and its key-mass columns there stay 0.
        max_kv = max(batch.rows[b].length for b in groups)
        max_kv = max_kv if routed else bucket(max_kv)
        column = columns[rows.request, rows.rank]
        positions = column - (width - batch.lengths)[request]
        if block_size is not None:  # (an empty group's: any row's, never read)
            first = rows.cu_seqlens[:-1].clamp(max=max(rows.num_rows - 1, 0))
            kv_len = (positions[first] // block_size + 1) * block_size
        options = {}
        if track is not None:
            options["track_rows"] = track[request, column]
        if visibility is not None:
            hidden_keys = torch.zeros(len(counts), max_kv, dtype=torch.bool, device=device)
            hidden_keys[rows.request, positions] = torch.ones_like(positions, dtype=torch.bool)  # `= True`: a host copy
            options.update(write_cache=False, hidden_keys=hidden_keys, self_visibility=visibility)
        if routed:
            options["routing"] = self._routing(batch, groups, rows, positions, writes_cache=visibility is None)
        metadata = AttentionMetadata.build(rows, kv_start, kv_len, positions, max_kv, ordered=self.batch_invariant,
                                           **options)
        if kept is not None and any(kept):
            unwritten = rows.rank < self.constant(kept)[rows.request]
            metadata.slot_mapping = metadata.slot_mapping.masked_fill(unwritten, self.cache.scratch_row)
        ids = batch.tokens[request, column] if input_ids is None else input_ids[rows.request, rows.rank]
        return CachedPass(rows, request, column, ids, positions, metadata, tuple(batch.tokens.shape))

    def _routing(self, batch: DecodeBatch, order: list[int], rows: FlatRows, positions: torch.Tensor,
                 writes_cache: bool) -> PromptRouting:
        """The pass's routed prompts (batch rows `order`); the keys read are counted in the batch's counters."""
        requests = [batch.rows[b] for b in order]
        routing = PromptRouting.build([row.prompt_length for row in requests], [row.length for row in requests],
                                      rows.counts, writes_cache, [row.params.kv_budget for row in requests],
                                      [row.params.kv_routing for row in requests], rows.request, positions,
                                      self.constant(order), batch.counters.prompt_keys_read,
                                      batch.counters.prompt_keys_dense, self.constant,
                                      clustered=[row.clustered for row in requests])
        for row, rebuilt in zip(requests, routing.rebuilding):
            row.clustered |= rebuilt
        return routing

    def constant(self, values: list[int]) -> torch.Tensor:
        """A short host list of ints (row counts) on the device, read-only. With CUDA graphs it is uploaded once
        and kept there: a step whose counts repeat uploads nothing, and a capture (which cannot copy from the
        host) finds it."""
        return self.graphs.constant(values) if self.graphs is not None else device_tensor(values, self.device)

    def run(self, p: CachedPass, key_mass: torch.Tensor | None = None) -> torch.Tensor:
        """The pass's final-normed hidden states [N, d]; with key_mass [G, max_kv], the attention mass of the
        tracked rows is added to it. On the PyTorch path (the CPU's) a pass over more than FULL_PASS_ROWS rows runs
        in parts of whole requests (`request_groups`), each attending to its own cache ranges alone: its
        activations would otherwise grow with the batch (seven 8,000-token first passes of the embedded model in one
        pass: 2.6 GB of max RSS against 1.9 in parts)."""
        if self.graphs is not None:
            return self.graphs.run_pass(p.input_ids, p.positions, p.metadata, key_mass)
        counts = p.rows.counts
        if self.kernels or p.metadata.routing is not None or sum(counts) <= FULL_PASS_ROWS:
            return self._forward_cached(p.input_ids, p.positions, p.metadata, key_mass)
        offsets, hidden = [0, *itertools.accumulate(counts)], None
        for group in request_groups(counts):
            rows = slice(offsets[group.start], offsets[group.stop])
            part = self._forward_cached(p.input_ids[rows], p.positions[rows],
                                        p.metadata.requests(group, rows, max(counts[group])),
                                        None if key_mass is None else key_mass[group])
            if hidden is None:
                hidden = part.new_empty(len(p.input_ids), part.shape[1])
            hidden[rows] = part
        return hidden

    def uses_graphs(self, rows: int) -> bool:
        """Whether a pass of `rows` query rows replays from CUDA graphs: graphs on, and not too large to gain."""
        return self.graphs is not None and rows <= MAX_GRAPH_ROWS

    def _forward_cached(self, input_ids, positions, metadata: AttentionMetadata, key_mass) -> torch.Tensor:
        return self.model.forward_cached(input_ids, positions, metadata, self.cache, key_mass, self.kernels)

    def logit_rows(self, flat_of_column: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """The flat rows [B, n] of a cached pass whose hidden states give the logits of the columns [B, n]
        (generated positions): the columns' own rows, or for a shifted architecture the rows `logit_shift`
        columns before. flat_of_column [B, W]: the pass's flat row of each column (-1: not in the pass, and
        then -1 here)."""
        return flat_of_column.gather(1, self._logit_source(columns))

    def logit_sources(self, selected: torch.Tensor) -> torch.Tensor:
        """selected [B, W] bool -> [B, W] bool: the columns whose hidden states give the selected columns' logits
        (a cached pass needs them among its query rows)."""
        shift = self.logit_shift
        return F.pad(selected[:, shift:], (0, shift)) if shift else selected

    def logits(self, hidden: torch.Tensor, flat_of_column: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Logits [B, n] (the model's dtype) of the columns [B, n] from a cached pass's final-normed hidden states
        [N, d] (a column whose row is not in the pass gets garbage, which must not be used)."""
        return self.logits_of(hidden, self.logit_rows(flat_of_column, columns))

    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [...] in the model's dtype of the flat rows [...] of a cached pass (-1: garbage, which must not be
        used). Their readers upcast to float64 themselves, so an fp32 copy ([32 x 32 rows, 126k] at batch 32: 0.5
        GB) would change no number."""
        return self._checked(self.model.compute_logits(hidden[rows.clamp(min=0)], self.invariant_gemms))

    def _checked(self, logits: torch.Tensor) -> torch.Tensor:
        """The first forward's logits, checked once (one host sync in the runner's life): finite weights can still
        overflow in the activations, and then every token would be garbage."""
        if not self.logits_checked:
            self.logits_checked = True
            if not torch.isfinite(logits).all():
                dtype = str(self.dtype).removeprefix("torch.")
                hint = "" if self.dtype == torch.float32 else "; try dtype float32"
                raise ValueError(f"the model's logits at its first forward pass are not finite (NaN or inf): its "
                                 f"activations overflow in {dtype}{hint}")
        return logits

    def _logit_source(self, columns: torch.Tensor) -> torch.Tensor:
        """The column whose hidden state gives each column's logits (clamped: the columns that matter are generated
        ones, never a row's first; padding entries may be column 0)."""
        return (columns - self.logit_shift).clamp(min=0) if self.logit_shift else columns
