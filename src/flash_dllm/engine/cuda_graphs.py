"""CUDA graphs for the decoding steps and the cached passes.

At small batches a step costs its launch time, not its GPU time: a cached pass launches about fifteen kernels
per layer and the step around it (the query choice, sampling, unmasking, the engine's finish test) about 150
more, and the GPU runs each faster than Python launches the next. What repeats is captured once and then
replayed in one launch:
- a whole step, for a method whose step is a function of the batch's tensors given its plan (the row counts
  of its passes): the engine replays it while the batch and the plan repeat (Flash-Cache's steady steps, the
  steps of dual-cache's blocks). It reads and writes the batch's tensors where they are.
- a cached pass, for the other methods, and a call of a step's part: Flash-Verify's step up to its verify
  pass's shape (its draft pass included), Elastic-Cache's reuse pass and its decoding of the window after its
  passes: their inputs are copied into the graph's static tensors and their outputs copied out; they read and
  write their batch in place. A pass that does not write the cache (Flash-Verify's verify pass, whose row count
  changes every iteration) is replayed padded to a bucket of rows, so that its shapes repeat.
A key is captured at its second sighting (CAPTURE_AFTER): one-off shapes (a request's first full pass) stay
eager, and the capture records the call without running it first (its eager sighting warmed up what it needs),
then replays it once, so it costs about one eager call. Only the kernel path can be captured: the PyTorch
references index with boolean masks, which synchronise with the host. `GraphedCalls` is the policy for any call of
tensors; `CudaGraphs` applies it to the runner's cached forward.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..cache.attention_metadata import AttentionMetadata, device_tensor
from .counters import COUNTERS

CAPTURE_AFTER = 1  # eager sightings of a shape before it is captured (a call may ask for more)
# Graphs kept (the least recently used dropped first): a batch-1 Elastic-Cache request of 512 tokens meets ~17 row
# counts of its reuse pass and ~20 refresh shapes, besides the steps' graphs. The graphs share one pool; each keeps
# only its inputs and outputs.
MAX_GRAPHS = 64
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
    and its graph. `first_outputs`: the outputs of the call the capture stands for, which ran once."""

    def __init__(self, fn, tensors: tuple[torch.Tensor, ...], pool, stream, run_first: bool):
        self.inputs = tuple(t.clone() for t in tensors)
        self.constants: list[torch.Tensor] = []  # the uploaded host lists it reads (GraphedCalls.constant)
        self.graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # run_first: the call runs eagerly before the capture, as a warm-up (cuBLAS's workspace on the capture
            # stream, lazily built tensors), and its outputs are the call's; the capture then records its kernels
            # without running them, so the state the call reads and rewrites (the cache, a step's tokens) is
            # advanced once. Without it, the replay below advances it.
            # (torch.cuda.graph() would also run gc.collect() and empty the allocator's cache at every capture.)
            first = fn(*self.inputs) if run_first else None
            self.graph.capture_begin(pool=pool)
            try:
                self.outputs = fn(*self.inputs)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self.first_outputs = first if run_first else self.replay(())

    def replay(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for static, t in zip(self.inputs, tensors):
            static.copy_(t)
        self.graph.replay()
        # the next replay overwrites the static outputs
        return tuple(None if t is None else t.clone() for t in self.outputs)


class _NotUploaded(Exception):
    """A capture asked for a host list that is not on the device: only an eager run may upload it."""


class GraphedCalls:
    """Calls `fn(*tensors) -> tuple of tensors` replayed from CUDA graphs, one per key (the caller's: every
    shape and host value the call depends on). A key is captured once it has been seen `capture_after` times
    (CAPTURE_AFTER unless the call says otherwise), without running it first where an eager sighting and an
    earlier capture have warmed up what it needs; at most `max_graphs` are kept, the least recently used dropped
    first. All graphs share one memory pool: they never run at the same time.

    A call made while another is being captured (a step's forward pass, inside the step's graph) runs eagerly
    into that capture. `constant` keeps the short host lists a call uploads (row counts) on the device, so that
    a capture, which cannot copy from the host, finds them there (the call's eager runs uploaded them); a graph
    holds the ones it reads."""

    MAX_CONSTANTS = 1024

    def __init__(self, device: torch.device, max_graphs: int = MAX_GRAPHS):
        self.device, self.max_graphs = device, max_graphs
        self.graphs: OrderedDict[tuple, _CapturedCall] = OrderedDict()
        self.sightings: dict[tuple, int] = {}  # eager runs of each key not captured
        self.constants: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()  # least recently used first
        self.read_by_capture: list[torch.Tensor] | None = None  # None: no capture under way
        self.may_upload = True  # False while a capture records a call that did not run first
        self.pool = None
        self.stream = None  # captures run off the default stream, on this one (made at the first)
        self.captures = self.replays = 0
        self.capturing = True  # False once a server is ready (`stop_capturing`)

    def run(self, key: tuple, fn, tensors: tuple[torch.Tensor, ...] = (),
            capture_after: int | None = None) -> tuple[torch.Tensor, ...]:
        """fn(*tensors), eagerly or replayed. fn may read and write other device tensors in place (the cache, a
        batch's state) as long as they outlive the key. capture_after: eager sightings before the capture (None:
        CAPTURE_AFTER)."""
        if self.read_by_capture is not None:  # called by a call being captured: run into its capture
            return fn(*tensors)
        captured = self.graphs.get(key)
        if captured is None:
            seen = self.sightings.get(key, 0)
            if not self.capture_due(key, capture_after):
                if len(self.sightings) > 1024:  # many one-off shapes: forget them
                    self.sightings.clear()
                self.sightings[key] = seen + 1
                return fn(*tensors)
            self.sightings.pop(key, None)
            # counted by the call's kind (a key's first item where it names one): /metrics' captures after ready
            with COUNTERS.timed("captures", key[0] if isinstance(key[0], str) else "cached pass"):
                try:
                    captured = self._capture(fn, tensors, run_first=seen == 0 or self.stream is None)
                except _NotUploaded:  # a host list of its eager sighting has left the memo since
                    captured = self._capture(fn, tensors, run_first=True)
            self.graphs[key] = captured
            self.captures += 1
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
            outputs, captured.first_outputs = captured.first_outputs, None
            return outputs
        self.graphs.move_to_end(key)
        self.replays += 1
        return captured.replay(tensors)

    def capture_due(self, key: tuple, capture_after: int | None = None) -> bool:
        """Whether `run` captures a key it holds no graph of at its next call: seen `capture_after` times (None:
        CAPTURE_AFTER), while capturing."""
        return self.capturing and self.sightings.get(key, 0) >= (CAPTURE_AFTER if capture_after is None
                                                                 else capture_after)

    def stop_capturing(self):
        """From now on the graphs held replay, and a key without one runs eagerly: no capture on a request's path
        (a server's, once ready). Under continuous batching a batch's tensors and shapes change at every arrival
        and departure, so that most whole-step graphs would be captured for a few replays; a pass's graph replays for
        any batch of its shape (`warmup.capture_steady_passes` captures the steady ones before ready). Measured
        (H100, random LLaDA-8B, Flash-Cache, `bench mix --capture-after-ready` against none): at batch 11-26 the
        throughput is within 0.5%; a lone dense request's steady step takes 9.5 against 8.3 ms, batch 2 28 against
        18 ms (benchmarks/HISTORY.md, 2026-12-06)."""
        self.capturing = False

    def _capture(self, fn, tensors: tuple[torch.Tensor, ...], run_first: bool) -> _CapturedCall:
        self.stream = self.stream or torch.cuda.Stream(self.device)
        self.read_by_capture, self.may_upload = [], run_first
        try:
            captured = _CapturedCall(fn, tensors, self.pool, self.stream, run_first)
        finally:
            constants, self.read_by_capture, self.may_upload = self.read_by_capture, None, True
        captured.constants = constants  # kept alive while the graph may replay them
        self.pool = captured.graph.pool()
        return captured

    def constant(self, values: list[int]) -> torch.Tensor:
        """values on the device, uploaded once and kept for the MAX_CONSTANTS most recently used lists
        (read-only: graphs read them where they are)."""
        key = tuple(values)
        uploaded = self.constants.get(key)
        if uploaded is None:
            if not self.may_upload:
                raise _NotUploaded
            uploaded = self.constants[key] = device_tensor(values, self.device)
            if len(self.constants) > self.MAX_CONSTANTS:
                self.constants.popitem(last=False)
        self.constants.move_to_end(key)
        if self.read_by_capture is not None:
            self.read_by_capture.append(uploaded)
        return uploaded


class CudaGraphs(GraphedCalls):
    """A cached forward pass `forward(input_ids, positions, metadata, key_mass) -> hidden`, bound to one KV
    cache, replayed from CUDA graphs for shapes that repeat; other calls (Elastic-Cache's reuse pass) share its
    graphs' pool and budget through `GraphedCalls.run`."""

    def __init__(self, forward, device: torch.device, max_graphs: int = MAX_GRAPHS):
        super().__init__(device, max_graphs)
        self.forward = forward

    def run_pass(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 key_mass: torch.Tensor | None = None) -> torch.Tensor:
        rows = input_ids.shape[0]
        input_ids, positions, metadata = ((input_ids, positions, metadata) if metadata.write_cache
                                          else pad_verify_pass(input_ids, positions, metadata))
        # A routed pass counts the keys it reads into the batch's counters, which a pass graph would not write.
        if input_ids.shape[0] > MAX_GRAPH_ROWS or metadata.routing is not None:
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
