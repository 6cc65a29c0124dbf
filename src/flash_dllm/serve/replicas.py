"""Data-parallel serving: engine replicas, each a process with its own LLM and engine loop, behind one HTTP front.

The front (this process) tokenises and validates; ReplicaPool, its engine client, sends each request to the live
replica with the fewest requests in flight (running plus waiting; ties: the lowest index), and the request's
events come back over a pipe: the same Accepted, Rejected, Prefix, Finished and Failed as from an AsyncEngine in
this process. A replica is a spawned process on its own GPUs (replica r: the visible GPUs r*TP .. r*TP+TP-1,
through CUDA_VISIBLE_DEVICES, set before CUDA starts in it) or, like every other replica, on the CPU. A replica
that exits fails only its own requests (503, naming it); the others keep serving, and /health and /metrics
report each replica.

Messages, front to replica: ("add", id, prompt_ids, params, stream), ("abort", id), ("stats",), ("stop",).
Replica to front: ("event", id, event), ("stats", Stats), ("ready",), ("failed", message).
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

from ..llm import LLM, RANDOM_PREFIX, default_model_path, resolve_device
from ..models import ARCHITECTURES, config_from_dir, resolve_checkpoint
from ..models.loader import random_config
from ..tokenizer import load_tokenizer
from .async_engine import AsyncEngine, Failed, Finished, Rejected, Request, Stats
from .protocol import ServerDefaults

log = logging.getLogger("flash_dllm.serve")
STATS_TIMEOUT_S = 2.0  # /metrics waits this long for a replica's counters (it answers between its steps' work)
STOP_TIMEOUT_S = 10.0  # a stopping replica ends its step and exits; past this it is terminated


class ReplicaError(RuntimeError):
    """A replica failed to start: the server stops."""


class ModelFront:
    """The model as the HTTP front sees it: its configuration and tokenizer, without weights (the replicas hold
    those). encode and decode are LLM's own, so the front tokenises exactly as a replica's LLM would."""

    encode = LLM.encode
    decode = LLM.decode

    def __init__(self, model: str | None = None):
        spec = str(model) if model is not None else str(default_model_path())
        if spec.startswith(RANDOM_PREFIX):
            path, self.config = None, random_config(spec[len(RANDOM_PREFIX):])
        else:
            path = resolve_checkpoint(spec)
            self.config = config_from_dir(path)
        self.tokenizer = load_tokenizer(path, ARCHITECTURES[self.config.architecture].vocab_merges_tokenizer)
        self.use_chat_template = self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))


def replica_devices(size: int, device: str | None, tensor_parallel_size: int = 1) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES: replica r gets the visible GPUs r*TP .. r*TP+TP-1 (one replica on a
    named GPU, cuda:i: from the i-th on); None for each on the CPU. A ValueError naming --data-parallel-size and
    its range when the GPUs are too few."""
    if size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
    where = resolve_device(device)
    if where.type != "cuda":
        return [None] * size
    if where.index is not None and size > 1:
        raise ValueError(f"--device {device} names one GPU, but each of the --data-parallel-size {size} replicas "
                         f"gets GPUs of its own: use --device cuda (CUDA_VISIBLE_DEVICES chooses the GPUs)")
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",")][:count] if visible else [str(i) for i in range(count)]
    ids = ids[where.index or 0:]
    most = len(ids) // tensor_parallel_size
    if size > most:
        within = f"must be between 1 and {most} here" if most >= 1 else "cannot be met"
        raise ValueError(f"--data-parallel-size {within}: {size} replicas x {tensor_parallel_size} GPU(s) each "
                         f"need {size * tensor_parallel_size}, {len(ids)} are visible")
    tp = tensor_parallel_size
    return [",".join(ids[r * tp:(r + 1) * tp]) for r in range(size)]


# The replica process.

@dataclass(eq=False)
class ReplicaRequest(Request):
    id: int = -1  # the front's id for it


@dataclass
class Outcome:
    """What Finished carries back to the front: the fields of the finished Sequence that the front reads."""
    output_ids: list[int]
    finish_reason: str
    steps: int
    nfe: int


class ReplicaEngine(AsyncEngine):
    """A replica's engine loop: its events go to the front over a pipe instead of to asyncio queues."""

    def __init__(self, llm: LLM, start_up: Callable[[], None], events: Connection, step_trace: str | None = None):
        super().__init__(llm, start_up, step_trace)
        self.events = events
        self.requests: dict[int, ReplicaRequest] = {}  # in flight, by id
        self._send_lock = threading.Lock()  # the engine thread and the main thread both send

    def send(self, message):
        with self._send_lock, contextlib.suppress(OSError):  # the front is gone: the main thread exits
            self.events.send(message)

    def add(self, request: ReplicaRequest):
        self.requests[request.id] = request
        if not self.enqueue([request], None):
            self._post(request, None, Failed(self.stop_reason or "the engine loop has stopped"))

    def abort_id(self, id: int):
        if (request := self.requests.pop(id, None)) is not None:
            self.abort(request)

    def snapshot(self) -> Stats:
        self.update_path_counters()
        stats = self.stats
        return replace(stats, finished=dict(stats.finished), recent=deque(stats.recent))

    def _post(self, request: ReplicaRequest, loop, event):
        if isinstance(event, (Rejected, Finished, Failed)):
            self.requests.pop(request.id, None)
        if isinstance(event, Finished):
            seq = event.seq
            event = Finished(Outcome(seq.output_ids, seq.finish_reason, seq.steps, seq.nfe))
        self.send(("event", request.id, event))


def run_replica(make_llm: Callable[[], LLM], defaults: ServerDefaults, commands: Connection, events: Connection,
                num_threads: int | None, step_trace: str | None = None):
    """A replica process: its LLM, start-up and engine loop, serving the front's messages until "stop", or until
    the front is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front stops us
    if num_threads is not None:
        import torch
        torch.set_num_threads(num_threads)
    from .api_server import start_up

    try:
        llm = make_llm()
    except BaseException as error:
        traceback.print_exc()
        events.send(("failed", f"{type(error).__name__}: {error}"))
        sys.exit(1)

    def start():
        try:
            start_up(llm, defaults)
        except BaseException as error:
            engine.send(("failed", f"{type(error).__name__}: {error}"))
            raise
        engine.send(("ready",))

    engine = ReplicaEngine(llm, start, events, step_trace)
    engine.start()
    while True:
        try:
            if not commands.poll(0.2):
                if not engine.is_alive():  # the loop has failed its requests; the front sees this process end
                    engine.send(("failed", engine.stop_reason))
                    sys.exit(1)
                continue
            message = commands.recv()
        except (EOFError, OSError):  # the front is gone
            os._exit(0)
        if message[0] == "add":
            _, id, prompt_ids, params, stream = message
            engine.add(ReplicaRequest(prompt_ids, params, stream, events=None, id=id))
        elif message[0] == "abort":
            engine.abort_id(message[1])
        elif message[0] == "stats":
            engine.send(("stats", engine.snapshot()))
        elif message[0] == "stop":
            engine.shutdown()  # the running requests fail ("the server is shutting down")
            sys.stderr.flush()
            os._exit(0)  # an engine thread still compiling its start-up is not waited for


# The front's side.

@dataclass(eq=False)
class Replica:
    index: int
    devices: str | None  # its CUDA_VISIBLE_DEVICES; None: on the CPU
    process: multiprocessing.process.BaseProcess | None = None
    commands: Connection | None = None  # front -> replica
    events: Connection | None = None    # replica -> front
    status: str = "starting"            # starting, ok, failed (its start-up), dead (exited while serving), stopped
    error: str | None = None
    requests: dict[int, Request] = field(default_factory=dict)  # in flight (running or waiting there), by id
    stats: Stats = field(default_factory=Stats)                 # its counters, as last reported
    stats_waiters: list[asyncio.Future] = field(default_factory=list)

    def send(self, message) -> bool:
        try:
            self.commands.send(message)
            return True
        except OSError:  # it has exited: its reader fails its requests
            return False

    def describe(self) -> dict:
        described = {"replica": self.index, "status": self.status, "pid": self.process and self.process.pid,
                     "devices": self.devices or "cpu", "requests": len(self.requests)}
        return described | ({"error": self.error} if self.error else {})


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def replica_trace_path(path: str | None, index: int, replicas: int) -> str | None:
    """`serve --step-trace PATH`'s file for replica `index`: PATH itself for a single one, else PATH with
    ".replica{index}" before its suffix (steps.jsonl -> steps.replica0.jsonl)."""
    if path is None or replicas == 1:
        return path
    where = Path(path)
    return str(where.with_name(f"{where.stem}.replica{index}{where.suffix}"))


class ReplicaPool:
    """The HTTP front's engine client over data-parallel replicas (AsyncEngine's interface).

    make_llm: builds a replica's LLM in its process (picklable: a module-level function or a partial of one).
    devices: each replica's CUDA_VISIBLE_DEVICES (replica_devices), None for the CPU; one replica each.
    on_ready: called once every replica has started; on_failure: with a ReplicaError when one fails to start.
    step_trace: the file each replica writes its engine steps to (replica_trace_path).
    """

    def __init__(self, make_llm: Callable[[], LLM], defaults: ServerDefaults, devices: list[str | None],
                 max_batch_size: int, step_trace: str | None = None):
        self.make_llm, self.defaults, self.step_trace = make_llm, defaults, step_trace
        self.replicas = [Replica(index, where) for index, where in enumerate(devices)]
        self.max_batch_size = max_batch_size * len(self.replicas)
        self.ready = threading.Event()
        self.on_ready: Callable[[], None] | None = None
        self.on_failure: Callable[[ReplicaError], None] | None = None
        self._placed: dict[Request, tuple[Replica, int]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    def start(self):
        """Spawn the replicas (from the event loop: their events are delivered on it)."""
        self._loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")  # no CUDA state or threads inherited
        atexit.register(self._kill)
        for replica in self.replicas:
            num_threads = None
            if replica.devices is None:  # the CPU's cores shared among the replicas
                import torch
                num_threads = max(1, torch.get_num_threads() // len(self.replicas))
            commands, replica.commands = context.Pipe(duplex=False)
            replica.events, events = context.Pipe(duplex=False)
            replica.process = context.Process(target=run_replica, name=f"flash-dllm-replica-{replica.index}",
                                              args=(self.make_llm, self.defaults, commands, events, num_threads,
                                                    replica_trace_path(self.step_trace, replica.index,
                                                                       len(self.replicas))))
            with visible_devices(replica.devices):
                replica.process.start()
            commands.close()  # the replica holds these ends now: its exit closes the pipes
            events.close()
            threading.Thread(target=self._read, args=(replica,), name=f"flash-dllm-replica-{replica.index}-events",
                             daemon=True).start()

    def shutdown(self):
        """Stop every replica: each fails its running requests and exits; terminated past STOP_TIMEOUT_S."""
        self._closing = True
        started = [replica for replica in self.replicas if replica.process is not None]
        for replica in started:
            replica.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for replica in started:
            replica.process.join(max(deadline - time.monotonic(), 0))
        self._kill()
        atexit.unregister(self._kill)

    def _kill(self):
        for replica in self.replicas:
            if replica.process is not None and replica.process.is_alive():
                log.warning("replica %d did not stop: terminating it", replica.index)
                replica.process.terminate()
                replica.process.join(5)
                if replica.process.is_alive():
                    replica.process.kill()
                    replica.process.join()

    def is_alive(self) -> bool:
        return any(replica.status in ("starting", "ok") for replica in self.replicas)

    def health(self) -> dict:
        statuses = {replica.status for replica in self.replicas}
        if statuses == {"ok"}:
            status = "ok"
        elif "failed" in statuses:
            status = "failed"
        elif "starting" in statuses:
            status = "starting"
        elif "ok" in statuses:
            status = "degraded"  # serving on the live replicas
        else:
            status = "stopped"
        return {"status": status, "replicas": [replica.describe() for replica in self.replicas]}

    async def replica_stats(self) -> list[tuple[str | None, Stats, bool]]:
        """Each replica's counters, asked of the live ones now (the last ones reported for the others)."""
        waiters = []
        for replica in self.replicas:
            if replica.status in ("starting", "ok"):
                waiter = self._loop.create_future()
                replica.stats_waiters.append(waiter)
                if replica.send(("stats",)):
                    waiters.append(waiter)
        if waiters:
            await asyncio.wait(waiters, timeout=STATS_TIMEOUT_S)
        return [(str(replica.index), replica.stats, replica.status == "ok") for replica in self.replicas]

    async def submit(self, requests: list[Request]) -> list:
        """Send each request to the live replica with the fewest in flight; returns once each is queued there,
        rejected, or failed."""
        for request in requests:
            replica = self._route()
            if replica is None:
                request.events.put_nowait(Failed("no replica is alive", 503))
                continue
            id = next(self._ids)
            replica.requests[id] = request
            self._placed[request] = (replica, id)
            replica.send(("add", id, request.prompt_ids, request.params, request.stream))
        return [await request.events.get() for request in requests]

    def abort(self, request: Request):
        placed = self._placed.pop(request, None)
        if placed is not None:  # a finished request is already gone
            replica, id = placed
            del replica.requests[id]
            replica.send(("abort", id))

    def _route(self) -> Replica | None:
        live = [replica for replica in self.replicas if replica.status == "ok"]
        return min(live, key=lambda replica: (len(replica.requests), replica.index), default=None)

    # A thread per replica reads its events; they are handled on the event loop.

    def _read(self, replica: Replica):
        while replica.events in wait([replica.events, replica.process.sentinel]):  # else: the process ended
            try:
                message = replica.events.recv()
            except (EOFError, OSError):
                break
            self._call(self._on_message, replica, message)
        replica.process.join()
        self._call(self._on_exit, replica)

    def _call(self, function, *args):
        with contextlib.suppress(RuntimeError):  # the event loop has closed: the server has stopped
            self._loop.call_soon_threadsafe(function, *args)

    def _on_message(self, replica: Replica, message: tuple):
        kind = message[0]
        if kind == "event":
            _, id, event = message
            request = replica.requests.get(id)
            if request is None:  # aborted
                return
            if isinstance(event, (Rejected, Finished, Failed)):
                del replica.requests[id]
                self._placed.pop(request, None)
            request.events.put_nowait(event)
        elif kind == "stats":
            replica.stats = message[1]
            for waiter in replica.stats_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            replica.stats_waiters.clear()
        elif kind == "ready":
            replica.status = "ok"
            if all(other.status == "ok" for other in self.replicas):
                self.ready.set()
                if self.on_ready is not None:
                    self.on_ready()
        elif kind == "failed":
            replica.error = message[1]

    def _on_exit(self, replica: Replica):
        reason = exit_reason(replica.process.exitcode)
        if self._closing:
            replica.status = "stopped"
        elif replica.status == "starting":
            replica.status = "failed"
            replica.error = f"{replica.error} ({reason})" if replica.error else reason
            log.error("replica %d failed to start: %s", replica.index, replica.error)
            if self.on_failure is not None:
                self.on_failure(ReplicaError(f"replica {replica.index} failed to start: {replica.error}"))
        else:
            replica.status = "dead"
            replica.error = f"{replica.error} ({reason})" if replica.error else reason
            log.error("replica %d stopped: %s; %d request(s) fail", replica.index, replica.error,
                      len(replica.requests))
        message = f"replica {replica.index} stopped ({reason}) while this request ran there"
        for request in replica.requests.values():
            self._placed.pop(request, None)
            request.events.put_nowait(Failed(message, 503))
        replica.requests.clear()
        for waiter in replica.stats_waiters:
            if not waiter.done():
                waiter.set_result(None)
        replica.stats_waiters.clear()


@contextlib.contextmanager
def visible_devices(devices: str | None):
    """CUDA_VISIBLE_DEVICES set to `devices` while a replica is spawned (it inherits the environment)."""
    if devices is None:
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
