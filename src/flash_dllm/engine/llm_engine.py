"""The engine: requests in, decoding steps over one running batch, finished sequences out.

Requests may be added at any time; each `step()` first admits waiting requests into free rows, runs one
denoising step for every row and retires the rows that finished. The KV cache of the cached methods is
allocated at the first request that needs it, sized by `kv_cache_bytes`; on the GPU the Triton kernels are
compiled then (warmup.py), before any request is timed.
"""
from __future__ import annotations

import itertools
import time

import torch

from ..cache import CacheAllocator, KVCache
from ..decoding import elastic, flash_cache, lossless
from ..decoding.step import denoise_step
from ..sampling_params import SamplingParams
from ..tokenizer import SpecialTokens
from .batch import DecodeBatch
from .cuda_graphs import GraphedModel
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .warmup import compile_kernels


# Methods that keep state per position (tracking, windows, drafts): its initial value for a new sequence.
POSITION_STATE = {"flash-cache": flash_cache.initial_position_state,
                  "flash-verify": flash_cache.initial_position_state,
                  "elastic": elastic.initial_position_state, "lossless": lossless.initial_position_state}

class LLMEngine:
    """cuda_graphs: replay the cached passes whose shapes repeat from CUDA graphs (needs the kernel path)."""

    def __init__(self, model, special: SpecialTokens, max_batch_size: int = 32, kv_cache_bytes: int | None = None,
                 cuda_graphs: bool = False):
        if cuda_graphs and not model.use_kernels:
            raise ValueError("cuda_graphs needs the Triton kernel path (model.use_kernels)")
        self.model = model
        self.runner = model  # what the steps call: the model, or the model with graphed cached passes
        self.cuda_graphs = cuda_graphs
        self.special = special
        weights = next(model.parameters())
        self.device, self.dtype = weights.device, weights.dtype
        self.scheduler = Scheduler(max_batch_size)
        self.batch: DecodeBatch | None = None
        self.kv_cache_bytes = kv_cache_bytes
        self.cache: KVCache | None = None
        self.allocator: CacheAllocator | None = None
        self.stop_ids = torch.tensor(special.stop_ids, device=self.device)
        self._request_ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_fits(len(prompt_ids), params)
        seq = Sequence(next(self._request_ids), list(prompt_ids), params)
        self.scheduler.add(seq)
        return seq

    def check_fits(self, prompt_length: int, params: SamplingParams):
        """Raise now, not after the queue drains, for a request that the KV cache can never hold."""
        if params.uses_cache:
            self._ensure_cache(params)
            length = prompt_length + params.max_tokens
            if length > self.allocator.num_rows:
                raise ValueError(f"a sequence of {length} tokens can never fit in a KV cache of "
                                 f"{self.allocator.num_rows} tokens; raise kv_cache_bytes or shorten the request")

    def abort(self, seqs: list[Sequence]):
        """Drop unfinished requests, waiting or running, and free their cache rows."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
            if seq.cache_base is not None:
                self.allocator.release(seq.cache_base, seq.length)
            seq.finish([], "abort", seq.steps, seq.nfe)

    def _ensure_cache(self, params: SamplingParams):
        """Allocate the cache at the first request that needs it. If that request is elastic, the budget also
        holds the per-layer hidden states; a later elastic request adds them beyond the budget."""
        if self.cache is not None:
            return
        budget = self.kv_cache_bytes
        if budget is None:  # default: 40% of free GPU memory, or 1 GiB of host memory
            budget = int(0.4 * torch.cuda.mem_get_info(self.device)[0]) if self.device.type == "cuda" else 1 << 30
        self.cache = KVCache.from_budget(self.model.config, budget, self.dtype, self.device,
                                         with_hidden=params.caches_hidden_states)
        self.allocator = CacheAllocator(self.cache.num_rows)
        if self.model.use_kernels and self.device.type == "cuda":
            compile_kernels(self.model, self.cache)
        if self.cuda_graphs:
            self.runner = GraphedModel(self.model, self.cache)

    def _reserve(self, seq: Sequence) -> bool:
        if not seq.params.uses_cache:
            return True
        seq.cache_base = self.allocator.allocate(seq.length)
        return seq.cache_base is not None

    def has_unfinished(self) -> bool:
        running = self.batch is not None and any(not seq.is_finished for seq in self.batch.seqs)
        return running or bool(self.scheduler.waiting)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one denoising step over the running batch; return the sequences that finished in it."""
        self._refresh_batch()
        if self.batch is None:
            return []
        denoise_step(self.runner, self.batch, self.cache, self.special.mask_id, self.stop_ids)
        return self._collect_finished()

    def _refresh_batch(self):
        """Drop the rows that finished last step and admit waiting requests; rebuild only on a change."""
        previous = self.batch
        running = [seq for seq in previous.seqs if not seq.is_finished] if previous is not None else []
        admitted = self.scheduler.admit(running, self._reserve)
        if previous is not None and len(running) == len(previous.seqs) and not admitted:
            return
        if previous is not None:
            previous.unpack()
        for seq in admitted:
            prompt = torch.tensor(seq.prompt_ids, dtype=torch.long, device=self.device)
            masks = torch.full((seq.params.max_tokens,), self.special.mask_id, device=self.device)
            seq.tokens = torch.cat([prompt, masks])
            seq.counters = torch.zeros(4, dtype=torch.long, device=self.device)
            if seq.params.method in POSITION_STATE:
                seq.position_state = POSITION_STATE[seq.params.method](seq.length, self.device)
            seq.status = SequenceStatus.RUNNING
            seq.start_time = time.perf_counter()
        rows = running + admitted
        self.batch = DecodeBatch.build(rows, self.special.pad_id, self.device) if rows else None
        if self.batch is not None and self.batch.params.method == "elastic":  # carry the host query counts
            carried = dict(zip(previous.seqs, previous.host_query_rows)) if running else {}
            self.batch.host_query_rows = [carried.get(seq, seq.length) for seq in rows]  # new: a full pass

    def _collect_finished(self) -> list[Sequence]:
        """A row is finished when every position up to its first eos/eot is decoded, or all are."""
        batch = self.batch
        generated = batch.tokens[:, batch.gen_start:]
        length = generated.shape[1]
        index = torch.arange(length, device=self.device)
        first_stop = torch.where(torch.isin(generated, self.stop_ids), index, length).amin(dim=1)
        first_mask = torch.where(generated == self.special.mask_id, index, length).amin(dim=1)
        finished = (first_stop < first_mask) | (first_mask == length)
        host = [finished.long(), batch.block_index, batch.step_in_block]
        if batch.next_query_rows is not None:
            host.append(batch.next_query_rows)
        state = torch.stack(host).tolist()  # the one sync
        for seq, block_index, step_in_block in zip(batch.seqs, state[1], state[2]):
            seq.block_index, seq.step_in_block = block_index, step_in_block
        if batch.next_query_rows is not None:
            batch.host_query_rows = state[3]
        rows = [row for row, is_done in enumerate(state[0]) if is_done]
        if not rows:
            return []
        stops, steps, nfe = (t[rows].tolist() for t in (first_stop, batch.steps, batch.nfe))
        for row, stop, num_steps, num_fwd in zip(rows, stops, steps, nfe):
            seq = batch.seqs[row]
            if seq.cache_base is not None:
                self.allocator.release(seq.cache_base, seq.length)
            seq.finish(generated[row, :stop].tolist(), "stop" if stop < length else "length", num_steps, num_fwd)
        return [batch.seqs[row] for row in rows]
