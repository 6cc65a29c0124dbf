"""CUDA graphs for the cached forward pass.

A cached pass launches about fifteen kernels per layer; at small batches the GPU runs each faster than
Python launches the next, so a step costs its launch time, not its GPU time. A pass whose shapes repeat
(Flash-Cache's fixed query budget, a dual-cache block step, Flash-Verify's draft pass) is captured once and
then replayed: its inputs are copied into the graph's static tensors, the graph replays every kernel in one
launch, and the output is copied out. A capture costs about two passes, so a shape is captured only once
it has been seen CAPTURE_AFTER times: one-off shapes (a request's first full pass) stay eager. A pass that
does not write the cache (Flash-Verify's verify pass, whose row count changes every iteration) is replayed
padded to a bucket of rows, so that its shapes repeat. Only the kernel path can be captured: the PyTorch
references index with boolean masks, which synchronise with the host.
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


class _CapturedPass:
    """One captured pass: the static tensors it reads and writes, and its graph."""

    def __init__(self, forward, input_ids, positions, metadata: AttentionMetadata, key_mass, pool, stream):
        self.input_ids, self.positions = input_ids.clone(), positions.clone()
        self.metadata = dataclasses.replace(metadata, **{name: t.clone()
                                                         for name, t in _metadata_tensors(metadata).items()})
        self.key_mass = None if key_mass is None else key_mass.clone()
        run = lambda: forward(self.input_ids, self.positions, self.metadata, self.key_mass)
        # Warm up before capturing (cuBLAS workspaces, lazily built tensors). It writes the same cache rows
        # with the same values as the pass itself will, and key_mass is reloaded before every replay.
        # (torch.cuda.graph() would also run gc.collect() and empty the allocator's cache at every capture.)
        stream.wait_stream(torch.cuda.current_stream())
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            run()
            self.graph.capture_begin(pool=pool)
            try:
                self.output = run()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self, input_ids, positions, metadata: AttentionMetadata, key_mass) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        static = _metadata_tensors(self.metadata)
        for name, t in _metadata_tensors(metadata).items():
            static[name].copy_(t)
        if key_mass is not None:
            self.key_mass.copy_(key_mass)
        self.graph.replay()
        if key_mass is not None:
            key_mass.copy_(self.key_mass)
        return self.output.clone()  # the next replay overwrites the static output


class CudaGraphs:
    """A cached forward pass `forward(input_ids, positions, metadata, key_mass) -> hidden`, bound to one KV
    cache, replayed from CUDA graphs for shapes that repeat (at most `max_graphs`, least recently used
    dropped first)."""

    def __init__(self, forward, max_graphs: int = 16):
        self.forward, self.max_graphs = forward, max_graphs
        self.passes: OrderedDict[tuple, _CapturedPass] = OrderedDict()
        self.sightings: dict[tuple, int] = {}  # eager runs of each shape not captured
        self.pool = None    # one memory pool for all graphs: they never run at the same time
        self.stream = None  # captures run off the default stream, on this one (made at the first)
        self.captures = self.replays = 0

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            key_mass: torch.Tensor | None = None) -> torch.Tensor:
        rows = input_ids.shape[0]
        graph_inputs = ((input_ids, positions, metadata) if metadata.write_cache
                        else pad_verify_pass(input_ids, positions, metadata))
        if graph_inputs[0].shape[0] > MAX_GRAPH_ROWS:
            return self.forward(input_ids, positions, metadata, key_mass)
        key = signature(graph_inputs[0], graph_inputs[2], key_mass)
        captured = self.passes.get(key)
        if captured is None:
            if self.sightings.get(key, 0) < CAPTURE_AFTER:
                if len(self.sightings) > 1024:  # many one-off shapes: forget them
                    self.sightings.clear()
                self.sightings[key] = self.sightings.get(key, 0) + 1
                return self.forward(input_ids, positions, metadata, key_mass)
            del self.sightings[key]
            captured = self.passes[key] = self._capture(*graph_inputs, key_mass)
            self.captures += 1
            if len(self.passes) > self.max_graphs:
                self.passes.popitem(last=False)
        self.passes.move_to_end(key)
        self.replays += 1
        return captured.replay(*graph_inputs, key_mass)[:rows]

    def _capture(self, input_ids, positions, metadata: AttentionMetadata, key_mass) -> _CapturedPass:
        self.stream = self.stream or torch.cuda.Stream(input_ids.device)
        captured = _CapturedPass(self.forward, input_ids, positions, metadata, key_mass, self.pool, self.stream)
        self.pool = captured.graph.pool()
        return captured
