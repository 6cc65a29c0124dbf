"""The engine: requests in, decoding steps over one running batch, finished sequences out.

Requests may be added at any time; each `step()` first admits waiting requests into free rows, runs one
denoising step for every row and retires the rows that finished.
"""
from __future__ import annotations

import itertools
import time

import torch

from ..decoding.full_step import full_forward_step
from ..sampling_params import SamplingParams
from ..tokenizer import SpecialTokens
from .batch import DecodeBatch
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus


class LLMEngine:
    def __init__(self, model, special: SpecialTokens, max_batch_size: int = 32):
        self.model = model
        self.special = special
        self.device = next(model.parameters()).device
        self.scheduler = Scheduler(max_batch_size)
        self.batch: DecodeBatch | None = None
        self.stop_ids = torch.tensor(special.stop_ids, device=self.device)
        self._request_ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(next(self._request_ids), list(prompt_ids), params)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        running = self.batch is not None and any(not seq.is_finished for seq in self.batch.seqs)
        return running or bool(self.scheduler.waiting)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one denoising step over the running batch; return the sequences that finished in it."""
        self._refresh_batch()
        if self.batch is None:
            return []
        full_forward_step(self.model, self.batch, self.special.mask_id)
        return self._collect_finished()

    def _refresh_batch(self):
        """Drop the rows that finished last step and admit waiting requests; rebuild only on a change."""
        running = [seq for seq in self.batch.seqs if not seq.is_finished] if self.batch is not None else []
        admitted = self.scheduler.admit(running)
        if self.batch is not None and len(running) == len(self.batch.seqs) and not admitted:
            return
        if self.batch is not None:
            self.batch.unpack()
        for seq in admitted:
            prompt = torch.tensor(seq.prompt_ids, dtype=torch.long, device=self.device)
            masks = torch.full((seq.params.max_tokens,), self.special.mask_id, device=self.device)
            seq.tokens = torch.cat([prompt, masks])
            seq.counters = torch.zeros(4, dtype=torch.long, device=self.device)
            seq.status = SequenceStatus.RUNNING
            seq.start_time = time.perf_counter()
        rows = running + admitted
        self.batch = DecodeBatch.build(rows, self.special.pad_id, self.device) if rows else None

    def _collect_finished(self) -> list[Sequence]:
        """A row is finished when every position up to its first eos/eot is decoded, or all are."""
        batch = self.batch
        generated = batch.tokens[:, batch.gen_start:]
        length = generated.shape[1]
        index = torch.arange(length, device=self.device)
        first_stop = torch.where(torch.isin(generated, self.stop_ids), index, length).amin(dim=1)
        first_mask = torch.where(generated == self.special.mask_id, index, length).amin(dim=1)
        finished = (first_stop < first_mask) | (first_mask == length)
        rows = finished.nonzero().flatten().tolist()  # the step's one host sync
        if not rows:
            return []
        stops, steps, nfe = (t[rows].tolist() for t in (first_stop, batch.steps, batch.nfe))
        for row, stop, num_steps, num_fwd in zip(rows, stops, steps, nfe):
            batch.seqs[row].finish(generated[row, :stop].tolist(), stop < length, num_steps, num_fwd)
        return [batch.seqs[row] for row in rows]
