"""One engine loop shared by every HTTP request.

The engine runs on its own thread (the device work releases the GIL, so the event loop keeps serving). The
event loop hands it requests and aborts through an inbox; the thread admits them between steps, steps the
running batch, and posts each request's events back to its asyncio queue: `Accepted` or `Rejected` first,
then `Prefix` (the output's final tokens so far, streaming requests only) and at last `Finished` or
`Failed`. A request whose client goes away is aborted: its rows and cache range are freed at the next step,
and no other request notices. The thread first runs the server's start-up (the KV cache and the kernels'
compiles, serve/api_server.py's `start_up`); `ready` is set once that is done.

AsyncEngine is the HTTP front's engine client for one replica in this process; serve/replicas.py's
ReplicaPool is the same interface over data-parallel replicas in processes of their own: start, shutdown,
ready, is_alive, max_batch_size, submit, abort, health and replica_stats.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.counters import ReadyMark, StepLog, StepTrace
from ..engine.sequence import Sequence
from ..llm import LLM
from ..sampling_params import SamplingParams

log = logging.getLogger("flash_dllm.serve")
MAX_CONSECUTIVE_FAILURES = 3


@dataclass
class Accepted:
    pass


@dataclass
class Rejected:
    message: str  # the request can never run (e.g. the KV cache can never hold it): a 400


@dataclass
class Prefix:
    token_ids: list[int]  # the output's final tokens so far (grows step by step)
    steps: int            # denoising steps and forward passes so far
    nfe: int


@dataclass
class Finished:
    seq: Sequence


@dataclass
class Failed:
    message: str      # the engine failed while this request ran
    status: int = 500  # 503: no replica can run it (the one that held it died, or none is alive)


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent_length: int = 0  # tokens of the final prefix already posted


@dataclass
class Stats:
    """Counters for /metrics, written by the engine thread (single writer)."""

    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    rejected: int = 0
    generated_tokens: int = 0
    steps: int = 0          # denoising steps of finished requests
    nfe: int = 0            # forward passes of finished requests
    iterations: int = 0     # engine steps
    running: int = 0
    waiting: int = 0
    kv_cache_rows: int = 0
    kv_cache_used: int = 0
    kv_cache_compactions: int = 0  # the held ranges slid together so that a waiting request fits
    kv_cache_rows_moved: int = 0
    recent: deque = field(default_factory=deque)  # (finish time, tokens) of the last minute
    # On a request's path (engine/counters.py): kernel compiles, CUDA-graph captures and full garbage collections
    # after ready, with their seconds; the longest step of the last minute, and the largest ratio of a step to the
    # median step of its method, batch size, work and routed rows there (engine/counters.StepShape), with how many
    # steps of that shape the minute had.
    start_up_s: float = 0.0
    compiles_after_ready: int = 0
    compile_s_after_ready: float = 0.0
    captures_after_ready: int = 0
    capture_s_after_ready: float = 0.0
    collections_after_ready: int = 0
    collection_s_after_ready: float = 0.0
    longest_step_s: float = 0.0
    longest_step_ratio: float = 0.0
    longest_step_ratio_steps: int = 0

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        return sum(tokens for when, tokens in list(self.recent) if now - when <= window_s) / window_s


class AsyncEngine:
    def __init__(self, llm: LLM, start_up: Callable[[], None] | None = None, step_trace: str | None = None):
        """step_trace: a file to write every engine step to (engine/counters.StepTrace), from ready on."""
        self.llm = llm
        self.engine = llm.engine
        self.stats = Stats()
        self.ready_mark = ReadyMark()
        self.step_log = StepLog()
        self.step_trace = StepTrace(step_trace) if step_trace else None
        self._start_up = start_up
        self.ready = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._active: dict[Sequence, tuple[Request, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()  # no request enters the inbox once the loop has stopped
        self._stopped = False
        self.stop_reason: str | None = None  # why the loop stopped, once it has
        self._thread = threading.Thread(target=self._loop, name="flash-dllm-engine", daemon=True)

    def start(self):
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def max_batch_size(self) -> int:
        return self.engine.scheduler.max_batch_size

    def health(self) -> dict | None:
        """/health's body; None once the loop has stopped."""
        if not self.is_alive():
            return None
        return {"status": "ok" if self.ready.is_set() else "starting"}

    async def replica_stats(self) -> list[tuple[str | None, Stats, bool]]:
        """/metrics' counters: one replica, without a label."""
        self.update_path_counters()
        return [(None, self.stats, self.is_alive() and self.ready.is_set())]

    def update_path_counters(self):
        """Stats' compiles, captures, collections and longest step, as of now."""
        after, stats = self.ready_mark.after(), self.stats
        stats.compiles_after_ready, stats.compile_s_after_ready = after["compiles"].count, after["compiles"].seconds
        stats.captures_after_ready, stats.capture_s_after_ready = after["captures"].count, after["captures"].seconds
        stats.collections_after_ready = after["collections"].count
        stats.collection_s_after_ready = after["collections"].seconds
        stats.longest_step_s, stats.longest_step_ratio, stats.longest_step_ratio_steps = self.step_log.longest()

    def shutdown(self):
        self._stop.set()
        self._wakeup.set()
        if self.ready.is_set():  # a start-up still compiling is not waited for (the thread is a daemon)
            self._thread.join()

    async def submit(self, requests: list[Request]) -> list[Accepted | Rejected | Failed]:
        """Queue requests for the engine thread (together: they join the same step); returns once each is
        queued there, rejected, or failed."""
        if not self.enqueue(requests, asyncio.get_running_loop()):
            return [Failed("the engine loop has stopped") for _ in requests]
        return [await request.events.get() for request in requests]

    def enqueue(self, requests: list[Request], loop: asyncio.AbstractEventLoop | None) -> bool:
        """Queue requests for the engine thread, whose events go to `loop`; False once the loop has stopped."""
        with self._lock:
            if self._stopped:
                return False
            for request in requests:
                self._inbox.put(("add", request, loop))
        self._wakeup.set()
        return True

    def abort(self, request: Request):
        self._inbox.put(("abort", request, None))
        self._wakeup.set()

    # The engine thread.

    def _post(self, request: Request, loop: asyncio.AbstractEventLoop, event):
        loop.call_soon_threadsafe(request.events.put_nowait, event)

    def _inbox_items(self):
        """What the inbox holds now: (kind, request, loop), oldest first."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self):
        for kind, request, loop in self._inbox_items():
            if kind == "add":
                try:
                    request.seq = self.engine.add_request(request.prompt_ids, request.params)
                except ValueError as error:  # it can never run here (e.g. the KV cache can never hold it)
                    self.stats.rejected += 1
                    self._post(request, loop, Rejected(str(error)))
                    continue
                except Exception as error:  # e.g. out of memory allocating the KV cache: this request only
                    log.exception("admitting a request failed")
                    self.stats.finished["error"] += 1
                    self._post(request, loop, Failed(f"{type(error).__name__}: {error}"))
                    continue
                self._active[request.seq] = (request, loop)
                self._post(request, loop, Accepted())
            elif request.seq in self._active:  # abort: a finished request is already gone
                del self._active[request.seq]
                self.engine.abort([request.seq])
                self.stats.finished["abort"] += 1

    def _loop(self):
        message = "the server is shutting down"
        try:
            start = time.perf_counter()
            if self._start_up is not None:
                self._start_up()
            self.stats.start_up_s = time.perf_counter() - start
            self.ready_mark.mark()  # compiles and captures from now on are on a request's path
            self.ready.set()
            self._serve()
        except BaseException as error:
            log.exception("the engine loop stopped")
            message = f"the engine loop stopped: {type(error).__name__}: {error}"
        finally:  # nobody may wait for an event that will never come
            with self._lock:
                self._stopped = True
                self.stop_reason = message
            for kind, request, loop in self._inbox_items():
                if kind == "add":
                    self._post(request, loop, Failed(message))
            self._fail(list(self._active), message)
            if self.step_trace is not None:
                self.step_trace.close()

    def _serve(self):
        failures = 0  # consecutive failed steps: a device that fails every step ends the loop (/health: 503)
        while not self._stop.is_set():
            self._drain_inbox()
            self._update_gauges()
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                if self.step_trace is not None:
                    self.step_trace.begin()
                start = time.perf_counter()
                finished = self.engine.step()
                end = time.perf_counter()
                self.step_log.record(end - start, self.engine.last_step, end)
                if self.step_trace is not None:
                    self._trace_step(end, end - start)
                streaming = [(seq, *self._active[seq]) for seq in self.engine.running
                             if not seq.is_finished and seq in self._active and self._active[seq][0].stream]
                self._post_prefixes(streaming)
            except Exception as error:  # a device or engine failure: fail the running batch, keep serving
                log.exception("engine step failed")
                failures += 1
                if failures == MAX_CONSECUTIVE_FAILURES:
                    raise
                running = [seq for seq in self.engine.running if not seq.is_finished and seq in self._active]
                self._fail(running, f"the engine failed: {type(error).__name__}: {error}")
                continue
            failures = 0
            self.stats.iterations += 1
            for seq in finished:
                if seq not in self._active:
                    continue
                request, loop = self._active.pop(seq)
                self._count(seq)
                self._post(request, loop, Finished(seq))
            self._update_gauges()

    def _trace_step(self, end: float, seconds: float):
        engine = self.engine
        self.step_trace.record(end, seconds, engine.last_step, engine.last_step_rows, engine.num_running,
                               len(engine.scheduler.waiting), sum(seq.length for seq in engine.running))

    def _post_prefixes(self, streaming: list):
        grown = [(seq, request, loop) for seq, request, loop in streaming if seq.final_length > request.sent_length]
        prefixes = self.engine.final_prefixes([seq for seq, _, _ in grown])
        for (seq, request, loop), (ids, steps, nfe) in zip(grown, prefixes):
            request.sent_length = len(ids)
            self._post(request, loop, Prefix(ids, steps, nfe))

    def _fail(self, seqs: list[Sequence], message: str):
        self.engine.abort(seqs)
        for seq in seqs:
            request, loop = self._active.pop(seq)
            self.stats.finished["error"] += 1
            self._post(request, loop, Failed(message))

    def _count(self, seq: Sequence):
        stats = self.stats
        stats.finished[seq.finish_reason] += 1
        stats.generated_tokens += len(seq.output_ids)
        stats.steps += seq.steps
        stats.nfe += seq.nfe
        now = time.perf_counter()
        stats.recent.append((now, len(seq.output_ids)))
        while stats.recent and now - stats.recent[0][0] > 60:
            stats.recent.popleft()

    def _update_gauges(self):
        stats, engine = self.stats, self.engine
        stats.running = engine.num_running
        stats.waiting = len(engine.scheduler.waiting)
        if engine.allocator is not None:
            stats.kv_cache_rows = engine.allocator.num_rows
            stats.kv_cache_used = engine.allocator.num_rows - engine.allocator.num_free
            stats.kv_cache_compactions, stats.kv_cache_rows_moved = engine.compactions, engine.rows_moved
