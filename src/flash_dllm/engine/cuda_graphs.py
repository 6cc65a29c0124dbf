"""CUDA graphs for the cached passes.

A cached pass launches about fifteen kernels per layer; at small batches the GPU runs each faster than
Python launches the next, so a step costs its launch time, not its GPU time. A pass whose shapes repeat
(Flash-Cache's fixed query budget, a dual-cache block step, Flash-Verify's draft pass) is captured once and
then replayed: its inputs are copied into the graph's static tensors, the graph replays every kernel in one
launch, and the output is copied out. A capture costs about two passes, so a shape is captured only once
it has been seen CAPTURE_AFTER times: one-off shapes (a request's first full pass) stay eager. A pass that
does not write the cache (Flash-Verify's verify pass, whose row count changes every iteration) is replayed
padded to a bucket of rows, so that its shapes repeat. Only the kernel path can be captured: the PyTorch
references index with boolean masks, which synchronise with the host. `GraphedCalls` is the policy for any
call of tensors (Elastic-Cache's reuse pass, with its drift test, is one); `CudaGraphs` applies it to the
runner's cached forward.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata

CAPTURE_AFTER = 3  # eager sightings of a shape before it is captured
# Beyond this many query rows a pass is GPU-bound (its launches overlap its kernels), and a capture would
# only keep its activations in the graph pool (H200, batch 16, every repeating shape captured: peak memory
# 0.1-0.7 GB over weights + cache + 2 GB; it was within it without graphs).
MAX_GRAPH_ROWS = 2048


def bucket(rows: int) -> int:
    """Round a row count up to a multiple of 16 and of 1/8 of its power of two: at most 1/8 more rows."""
    granule = max(16, (1 << (rows - 1).bit_length()) // 8)
    return -(-rows // granule) * granule


def pad_verify_pass(input_ids, positions, metadata: AttentionMetadata):
    """A pass that does not write the cache, with rows appended after the last request's (cu_seqlens_q[-1]:
    they belong to no request, so no row attends to them and the attention kernel skips them; their outputs
    are dropped) and max_q, self_visibility padded to a bucket too."""
    extra, extra_q = bucket(input_ids.shape[0]) - input_ids.shape[0], bucket(metadata.max_q) - metadata.max_q
    pad_rows = lambda t: F.pad(t, (0, extra))
    visibility = metadata.self_visibility
    if visibility is not None:
        visibility = F.pad(visibility, (0, extra_q, 0, extra_q))
    return pad_rows(input_ids), pad_rows(positions), dataclasses.replace(
        metadata, slot_mapping=pad_rows(metadata.slot_mapping), max_q=metadata.max_q + extra_q,
        self_visibility=visibility, track_rows=None if metadata.track_rows is None else pad_rows(metadata.track_rows))


def _metadata_tensors(metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
    return {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)
            if isinstance(getattr(metadata, f.name), torch.Tensor)}


def signature(input_ids: torch.Tensor, metadata: AttentionMetadata, key_mass: torch.Tensor | None) -> tuple:
    """Everything a captured pass is specialised on: tensor shapes and dtypes, and the metadata's host values."""
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in _metadata_tensors(metadata).items())
    return (input_ids.shape[0], metadata.max_q, metadata.max_kv, metadata.write_cache, tensors,
            None if key_mass is None else tuple(key_mass.shape))


class _CapturedCall:
    """One captured call: the static tensors it reads (its inputs, copied in before each replay), its outputs
    and its graph."""

    def __init__(self, fn, tensors: tuple[torch.Tensor, ...], pool, stream, keep=None):
        self.inputs = tuple(t.clone() for t in tensors)
        # Warm up before capturing (cuBLAS workspaces, lazily built tensors). A call that writes the cache writes
        # the same rows with the same values as the call itself will; one that also reads what it writes (the
        # drift test reads the rows as cached before it rewrites them) names them in `keep`, and they are put
        # back after the warm-up, so that the first replay reads what an eager call would have.
        # (torch.cuda.graph() would also run gc.collect() and empty the allocator's cache at every capture.)
        stream.wait_stream(torch.cuda.current_stream())
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            saved = [(buffer, rows, buffer[rows].clone()) for buffer, rows in (keep() if keep else [])]
            fn(*self.inputs)
            for buffer, rows, values in saved:
                buffer[rows] = values
            self.graph.capture_begin(pool=pool)
            try:
                self.outputs = fn(*self.inputs)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for static, t in zip(self.inputs, tensors):
            static.copy_(t)
        self.graph.replay()
        # the next replay overwrites the static outputs
        return tuple(None if t is None else t.clone() for t in self.outputs)


class GraphedCalls:
    """Calls `fn(*tensors) -> tuple of tensors` replayed from CUDA graphs, one per key (the caller's: every
    shape and host value the call depends on). A key is captured once it has been seen CAPTURE_AFTER times (a
    capture costs about two calls, so one-off shapes stay eager); at most `max_graphs` are kept, the least
    recently used dropped first. All graphs share one memory pool: they never run at the same time."""

    def __init__(self, max_graphs: int = 16):
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _CapturedCall] = OrderedDict()
        self.sightings: dict[tuple, int] = {}  # eager runs of each key not captured
        self.pool = None
        self.stream = None  # captures run off the default stream, on this one (made at the first)
        self.captures = self.replays = 0

    def run(self, key: tuple, fn, tensors: tuple[torch.Tensor, ...], keep=None) -> tuple[torch.Tensor, ...]:
        """fn(*tensors), eagerly or replayed. keep() -> [(buffer, rows)]: state that fn reads before it writes
        it, restored after the warm-up run that precedes a capture."""
        captured = self.graphs.get(key)
        if captured is None:
            if self.sightings.get(key, 0) < CAPTURE_AFTER:
                if len(self.sightings) > 1024:  # many one-off shapes: forget them
                    self.sightings.clear()
                self.sightings[key] = self.sightings.get(key, 0) + 1
                return fn(*tensors)
            del self.sightings[key]
            captured = self.graphs[key] = self._capture(fn, tensors, keep)
            self.captures += 1
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        self.replays += 1
        return captured.replay(tensors)

    def _capture(self, fn, tensors, keep=None) -> _CapturedCall:
        self.stream = self.stream or torch.cuda.Stream(tensors[0].device)
        captured = _CapturedCall(fn, tensors, self.pool, self.stream, keep)
        self.pool = captured.graph.pool()
        return captured


class CudaGraphs(GraphedCalls):
    """A cached forward pass `forward(input_ids, positions, metadata, key_mass) -> hidden`, bound to one KV
    cache, replayed from CUDA graphs for shapes that repeat; other calls (Elastic-Cache's reuse pass) share its
    graphs' pool and budget through `GraphedCalls.run`."""

    def __init__(self, forward, max_graphs: int = 16):
        super().__init__(max_graphs)
        self.forward = forward

    def run_pass(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 key_mass: torch.Tensor | None = None) -> torch.Tensor:
        rows = input_ids.shape[0]
        input_ids, positions, metadata = ((input_ids, positions, metadata) if metadata.write_cache
                                          else pad_verify_pass(input_ids, positions, metadata))
        if input_ids.shape[0] > MAX_GRAPH_ROWS:
            return self.forward(input_ids, positions, metadata, key_mass)[:rows]
        names = list(_metadata_tensors(metadata))

        def forward(input_ids, positions, *rest):
            table = dataclasses.replace(metadata, **dict(zip(names, rest)))
            mass = rest[len(names)] if key_mass is not None else None
            return self.forward(input_ids, positions, table, mass), mass

        tensors = (input_ids, positions, *_metadata_tensors(metadata).values(),
                   *(() if key_mass is None else (key_mass,)))
        hidden, mass = self.run(signature(input_ids, metadata, key_mass), forward, tensors)
        if key_mass is not None and mass is not key_mass:  # replayed: the static buffer's sums come back
            key_mass.copy_(mass)
        return hidden[:rows]
