"""The engine: requests in, decoding steps over the running batches, finished sequences out.

Requests may be added at any time; each `step()` first admits waiting requests (engine/scheduler.py), each into
the running batch of its `batch_key`, then runs one iteration of one batch's decoding method for every row and
retires the rows that finished. A request whose cache rows are free but not in one range gets them by compacting
the cache (its held ranges slide to the start), not by waiting for neighbours to finish. The batches share the GPU
by time: the next to step is the one whose steps have taken the least time per row so far (a new batch starts
level with the least served), so that every running
request gets about the same share whatever its method costs a step, and a request of a rare key advances at once
instead of waiting for the common key's queue to drain. The KV cache of the cached methods is allocated by the
model runner at the first request that needs it (on the GPU the Triton kernels are compiled then, before any
request is timed); the engine hands out its rows, shared by all batches.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from ..batch import Counters, DecodeBatch, RowState
from ..cache import CacheAllocator
from ..cache.attention_metadata import device_tensor
from ..decoding.base import DecodingMethod
from ..decoding.registry import METHODS, method_of, methods_for
from ..sampling_params import SamplingParams, no_cache_to_route
from ..tokenizer import SpecialTokens
from .counters import StepShape, work_class
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus


@dataclass(eq=False)
class RunningBatch:
    """The running requests of one batch_key: the rows of its batch, and those admitted since it last stepped."""

    running: list[Sequence] = field(default_factory=list)  # the batch's sequences, row by row
    joining: list[Sequence] = field(default_factory=list)  # admitted, in the batch from its next step
    batch: DecodeBatch | None = None
    served_s: float = 0.0  # its steps' seconds over their rows, summed: the least served steps next

    @property
    def has_work(self) -> bool:
        return any(not seq.is_finished for seq in (*self.running, *self.joining))


class LLMEngine:
    def __init__(self, runner: ModelRunner, special: SpecialTokens, max_batch_size: int = 32):
        self.runner = runner
        self.special = special
        self.device = runner.device
        self.scheduler = Scheduler(max_batch_size)
        self.batches: dict[tuple, RunningBatch] = {}  # by batch_key, in order of creation
        self.current: RunningBatch | None = None  # the one that stepped last
        self.last_step: StepShape | None = None   # its method, rows, work and routed rows
        self.last_step_rows = 0                   # the query rows it computed (its work, exactly)
        self.allocator: CacheAllocator | None = None
        self.compactions = self.rows_moved = 0  # of the KV cache, and the rows they copied
        self.stop_ids = torch.tensor(special.stop_ids, device=self.device)
        self._request_ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_fits(len(prompt_ids), params)
        seq = Sequence(next(self._request_ids), list(prompt_ids), params, self.method(params).tail_tokens(params))
        self.scheduler.add(seq)
        return seq

    def check_fits(self, prompt_length: int, params: SamplingParams):
        """Raise now, not once it would run, for a request that the model's context or the KV cache can never
        hold."""
        max_position = self.runner.model.config.max_position
        if prompt_length + params.max_tokens > max_position:
            raise ValueError(f"prompt of {prompt_length} tokens + max_tokens {params.max_tokens} exceeds the "
                             f"model's maximum sequence length of {max_position}")
        method = self.method(params)
        if self.runner.logit_shift and not method.handles_logit_shift:
            able = ", ".join(m.name for m in METHODS.values() if m.handles_logit_shift)
            raise ValueError(f"method {method.name!r} does not handle this model's shifted logits yet; use {able}")
        attention = self.runner.model.config.attention
        if attention.kind not in method.attention_patterns:
            able = ", ".join(methods_for(attention.kind))
            raise ValueError(f"method {method.name!r} does not support this model's {attention} attention yet; "
                             f"use {able}")
        method.check_model(self.runner.model.config, params)
        if params.kv_routing is not None and not method.uses_cache:
            raise ValueError(no_cache_to_route(params.method))
        if params.kv_routing is not None and self.runner.batch_invariant:
            raise ValueError("kv_routing is not batch-invariant yet: its routed attention sums keys in the default "
                             "order; drop kv_routing or batch_invariant")
        if method.uses_cache:
            if self.allocator is None:
                cache = self.runner.allocate_cache(with_hidden=method.caches_hidden_states)
                self.allocator = CacheAllocator(cache.num_rows)
            length = prompt_length + params.max_tokens + method.tail_tokens(params)
            if length > self.allocator.num_rows:
                raise ValueError(f"a sequence of {length} tokens can never fit in a KV cache of "
                                 f"{self.allocator.num_rows} tokens; raise kv_cache_bytes or shorten the request")

    def method(self, params: SamplingParams) -> DecodingMethod:
        """The method that decodes requests of `params` on this model (registry.method_of: by its attention)."""
        return method_of(params.method, self.runner.model.config.attention.kind)

    @property
    def running(self) -> list[Sequence]:
        """Every admitted sequence of every running batch (finished ones until their batch next steps)."""
        return [seq for group in self.batches.values() for seq in (*group.running, *group.joining)]

    @property
    def num_running(self) -> int:
        """The running sequences that have not finished."""
        return sum(not seq.is_finished for seq in self.running)

    @property
    def batch(self) -> DecodeBatch | None:
        """The batch that stepped last."""
        return None if self.current is None else self.current.batch

    def abort(self, seqs: list[Sequence]):
        """Drop unfinished requests, waiting or running, and free their cache rows."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
            self._release(seq)
            seq.finish([], "abort", seq.steps, seq.nfe)

    def final_prefixes(self, seqs: list[Sequence]) -> list[tuple[list[int], int, int]]:
        """(final prefix, steps, nfe) of running sequences: the prefix is the generated tokens up to the first
        mask or eos/eot (a decoded token never changes, so these are the first tokens of the output). One
        transfer per running batch that holds some; a sequence in none (not yet in a batch) has none."""
        found, asked = {}, set(seqs)
        for group in self.batches.values():
            wanted = [(index, seq) for index, seq in enumerate(group.running) if seq in asked]
            if not wanted:
                continue
            batch = group.batch
            rows = torch.tensor([index for index, _ in wanted], device=self.device)
            counters = torch.stack([batch.counters.steps[rows], batch.counters.nfe[rows]], dim=1)
            generated = batch.tokens[rows, batch.gen_start:batch.gen_start + batch.params.max_tokens]
            host = torch.cat([generated, counters], dim=1).tolist()
            found.update({seq: (row[:seq.final_length], row[-2], row[-1]) for row, (_, seq) in zip(host, wanted)})
        return [found.get(seq, ([], 0, 0)) for seq in seqs]

    def _reserve(self, seq: Sequence) -> bool:
        if not self.method(seq.params).uses_cache:
            return True
        seq.cache_base = self.allocator.allocate(seq.length)
        if seq.cache_base is None and self.allocator.fits_compacted(seq.length):
            self.compact_cache()
            seq.cache_base = self.allocator.allocate(seq.length)
        return seq.cache_base is not None

    def _release(self, seq: Sequence):
        if seq.cache_base is not None:
            self.allocator.release(seq.cache_base, seq.length)

    def compact_cache(self):
        """Slide the held cache ranges to the cache's start (their rows copied on the device, in stream order with
        the steps) and move their sequences and batches with them. If the copy fails, the allocator and the
        sequences keep their ranges (whose rows may be torn: the caller fails the running requests)."""
        self.allocator.compact(self._move_ranges)

    @torch.inference_mode()
    def _move_ranges(self, moves: list[tuple[int, int, int]]):
        self.runner.cache.move_rows(moves)
        # the sequences that hold rows: every admitted one is placed in a batch before the next is reserved
        for seq in [seq for seq in self.running if seq.cache_base is not None]:
            seq.cache_base += next((new - old for old, new, rows in moves if old <= seq.cache_base < old + rows), 0)
            if seq.row is not None:
                seq.row.cache_base = seq.cache_base
        for group in self.batches.values():  # in place: a graph of the batch's step reads it there
            if group.batch is not None and group.batch.cache_base is not None:
                group.batch.cache_base.copy_(device_tensor([row.cache_base for row in group.batch.rows],
                                                           self.device))
        self.compactions += 1
        self.rows_moved += sum(rows for _, _, rows in moves)

    def has_unfinished(self) -> bool:
        return any(group.has_work for group in self.batches.values()) or bool(self.scheduler.waiting)

    def next_turn(self) -> tuple | None:
        """The key of the running batch that steps next: the least served (None: no batch has work)."""
        return min(self.batches, key=lambda key: self.batches[key].served_s, default=None)

    def step(self) -> list[Sequence]:
        """Admit waiting requests, run one iteration over the running batch whose turn it is (`next_turn`) and
        return the sequences that finished in it."""
        self.admit()
        return self.step_batch(self.next_turn())

    @torch.inference_mode()
    def step_batch(self, turn: tuple | None) -> list[Sequence]:
        """One iteration over the running batch of key `turn` (None: none), after `admit`; the sequences that
        finished in it. A tensor-parallel driver chooses the turn and its workers step the same. A method whose
        step is replayable runs it, with the finish test, from a CUDA graph while the batch and its plan repeat
        (the graph reads and writes the batch's tensors where they are; a new batch gets new graphs)."""
        if turn is None:
            return []
        self.current = group = self.batches[turn]
        start = time.perf_counter()
        try:
            return self._step(group)
        finally:
            group.served_s += (time.perf_counter() - start) / max(len(group.running), 1)

    def _step(self, group: RunningBatch) -> list[Sequence]:
        self._refresh_batch(group)
        method, batch = self.method(group.batch.params), group.batch
        rows = list(batch.rows)
        before = sum(row.query_rows for row in rows)
        try:
            return self._run_step(method, batch, group)
        finally:  # the rows' query counts advance on the host, also where the step replays from a graph
            self.last_step_rows = sum(row.query_rows for row in rows) - before
            self.last_step = StepShape(method.name, len(rows), work_class(self.last_step_rows),
                                       sum(row.params.kv_routing is not None for row in rows))

    def _run_step(self, method, batch: DecodeBatch, group: RunningBatch) -> list[Sequence]:
        runner = self.runner
        if not method.replayable:
            method.step(runner, batch)
            return self._collect_finished(group, *self._finish_state(method, batch))
        plan = method.plan(runner, batch)

        def whole_step():
            method.run(runner, batch, plan)
            return self._finish_state(method, batch)
        if runner.uses_graphs(plan.rows):
            return self._collect_finished(group, *runner.graphs.run(("step", batch.number, method.name, plan),
                                                                    whole_step))
        return self._collect_finished(group, *whole_step())

    def admit(self):
        """Drop the running batches left without work, and admit waiting requests into their key's batch (a new
        batch starts as served as the least served one). Deterministic: a tensor-parallel worker admits as its
        driver does."""
        for key in [key for key, group in self.batches.items() if not group.has_work]:
            del self.batches[key]
        for seq in self.scheduler.admit(self.num_running, self._reserve):
            key = seq.params.batch_key()
            if key not in self.batches:
                served = min((group.served_s for group in self.batches.values()), default=0.0)
                self.batches[key] = RunningBatch(served_s=served)
            self.batches[key].joining.append(seq)

    def _refresh_batch(self, group: RunningBatch):
        """Drop the rows that finished since the batch last stepped and add the joining ones; rebuild only on a
        change."""
        running = [seq for seq in group.running if not seq.is_finished]
        admitted = [seq for seq in group.joining if not seq.is_finished]  # an abort may have finished one
        group.joining = []
        if group.batch is not None and len(running) == len(group.running) and not admitted:
            return
        if group.batch is not None:
            group.batch.unpack(keep=[not seq.is_finished for seq in group.running])
        for seq in admitted:
            method = self.method(seq.params)
            prompt = torch.tensor(seq.prompt_ids, dtype=torch.long, device=self.device)
            masks = torch.full((seq.params.max_tokens + seq.tail,), self.special.mask_id, device=self.device)
            seq.row = RowState(params=seq.params, prompt_length=len(seq.prompt_ids),
                               tokens=torch.cat([prompt, masks]), counters=Counters.zeros(self.device),
                               state=method.initial_state(seq.length, self.device), cache_base=seq.cache_base)
            seq.status = SequenceStatus.RUNNING
            seq.start_time = time.perf_counter()
        group.running = running + admitted
        number = next(self.runner.batch_numbers)  # counted by the runner: engines may share one
        group.batch = DecodeBatch.build([seq.row for seq in group.running], self.special.mask_id, self.stop_ids,
                                        self.special.pad_id, number)

    def _finish_state(self, method: DecodingMethod, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device, after a step: [4 or 5, B] (finished, block index, step in block, final length, and the
        next query rows where the method sets them) and each row's first eos/eot [B]. A row is finished when
        every position up to its first eos/eot is final (decoded, and not open to the method's edits), or all
        are."""
        counters = batch.counters
        generated = batch.tokens[:, batch.gen_start:batch.gen_start + batch.params.max_tokens]
        length = generated.shape[1]
        index = torch.arange(length, device=self.device)
        first_stop = torch.where(torch.isin(generated, self.stop_ids), index, length).amin(dim=1)
        pending = generated == self.special.mask_id
        editable = method.editable(batch)
        if editable is not None:
            pending |= editable
        first_mask = torch.where(pending, index, length).amin(dim=1)
        finished = (first_stop < first_mask) | (first_mask == length)
        host = [finished.long(), counters.block_index, counters.step_in_block, torch.minimum(first_stop, first_mask)]
        if batch.next_query_rows is not None:
            host.append(batch.next_query_rows)
        return torch.stack(host), first_stop

    def _collect_finished(self, group: RunningBatch, finish_state: torch.Tensor,
                          first_stop: torch.Tensor) -> list[Sequence]:
        batch, counters = group.batch, group.batch.counters
        generated = batch.tokens[:, batch.gen_start:batch.gen_start + batch.params.max_tokens]
        length = generated.shape[1]
        state = finish_state.tolist()  # the one sync
        for seq, row, block_index, step_in_block, final in zip(group.running, batch.rows, *state[1:4]):
            row.block_index, row.step_in_block = block_index, step_in_block
            seq.final_length = final
        if batch.next_query_rows is not None:
            for row, count in zip(batch.rows, state[4]):
                row.next_query_rows = count
        done = [index for index, is_done in enumerate(state[0]) if is_done]
        if not done:
            return []
        finals = torch.stack([first_stop, counters.steps, counters.nfe, counters.prompt_keys_read,
                              counters.prompt_keys_dense])[:, done].tolist()
        for index, stop, num_steps, num_fwd, keys_read, keys_dense in zip(done, *finals):
            seq = group.running[index]
            self._release(seq)
            routed = seq.params.kv_routing is not None and keys_dense > 0
            seq.finish(generated[index, :stop].tolist(), "stop" if stop < length else "length", num_steps, num_fwd,
                       keys_read / keys_dense if routed else None)
        return [group.running[index] for index in done]
