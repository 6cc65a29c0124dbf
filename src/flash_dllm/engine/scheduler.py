"""Admission: which waiting requests join the running batch.

A batch holds requests with equal `SamplingParams.batch_key()`. New requests of the running batch's key
join as rows free up, but only while the oldest waiting request has that key too; otherwise the batch
drains and the oldest request's key runs next, so no request waits forever. A request that needs KV
cache rows is admitted only when `reserve` finds them; admission stops at the first that does not fit.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .sequence import Sequence


class Scheduler:
    def __init__(self, max_batch_size: int):
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def admit(self, running: list[Sequence], reserve: Callable[[Sequence], bool]) -> list[Sequence]:
        if not self.waiting:
            return []
        key = (running[0] if running else self.waiting[0]).params.batch_key()
        free = self.max_batch_size - len(running)
        if free <= 0 or self.waiting[0].params.batch_key() != key:
            return []
        admitted = []
        for seq in [seq for seq in self.waiting if seq.params.batch_key() == key][:free]:
            if not reserve(seq):
                break
            self.waiting.remove(seq)
            admitted.append(seq)
        return admitted
