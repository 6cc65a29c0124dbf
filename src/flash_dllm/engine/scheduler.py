"""Admission: which waiting requests start running.

Requests join in arrival order while fewer than `max_batch_size` rows run, each into the batch of its
`SamplingParams.batch_key()` (requests of different keys cannot share one: another method, generation length or
block length). Admission stops at the first request whose KV cache rows `reserve` cannot find, so that no later
request overtakes it forever. The engine steps the running batches in turn (engine/llm_engine.py).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from .sequence import Sequence


class Scheduler:
    def __init__(self, max_batch_size: int):
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def admit(self, num_running: int, reserve: Callable[[Sequence], bool]) -> Iterator[Sequence]:
        """The oldest waiting requests that fit beside `num_running` rows and get their cache rows, one at a time:
        the caller places each before the next `reserve` (which may fail, e.g. a compaction of the cache that
        runs out of memory), so that no admitted request is lost with it."""
        admitted = 0
        while self.waiting and num_running + admitted < self.max_batch_size and reserve(self.waiting[0]):
            admitted += 1
            yield self.waiting.popleft()
