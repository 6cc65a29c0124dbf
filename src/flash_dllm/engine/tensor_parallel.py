"""Tensor parallelism's processes: the driver (rank 0, the user's process) and its worker ranks.

Every rank holds its shard of the model (models/parallel.py), its own runner, KV cache and engine, and runs every
engine operation that the driver runs, in the same order: add_request, abort, step and the KV cache's allocation.
The collectives inside the model give every rank bit-identical logits, attention mass and drift cosines, so every
rank takes the same decisions (the unmasking, Flash-Cache's query choice, Flash-Verify's acceptance, Elastic-Cache's
refresh, the engine's scheduling) and the engines stay in lockstep with no other exchange; the outputs are read on
the driver only. The driver sends each operation (a module-level function and its arguments, pickled) over a gloo
group before running it itself; a worker waits for the next one without a time limit.

Two ways to start: `LLM(..., tensor_parallel_size=N)` spawns N - 1 worker processes (torch.multiprocessing, one per
GPU: cuda:i + rank from the driver's cuda:i); under `torchrun --nproc-per-node N` rank 0 is the driver and the other
ranks' `LLM(...)` serve it and then end their process.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..models.parallel import TensorParallel
from .llm_engine import LLMEngine
from .model_runner import ModelRunner

logger = logging.getLogger("flash_dllm")
WAIT = timedelta(days=365)  # a worker waits this long for the driver's next operation (a server may idle)
RECENT_OUTPUTS = 4096       # a worker keeps the tokens of this many finished requests (checked by tests)


@dataclass(frozen=True)
class RankSpec:
    """What a rank builds: the LLM's arguments that shape the model, its runner and its engine."""
    model: str
    device: torch.device  # the driver's; rank r runs on the GPU r after it, or on the CPU
    dtype: torch.dtype
    seed: int
    quantization: str | None
    kv_cache_bytes: int | None
    kernels: bool | None
    cuda_graphs: bool | None
    batch_invariant: bool
    kv_cache_dtype: str | None
    max_batch_size: int

    def device_of(self, rank: int) -> torch.device:
        if self.device.type != "cuda":
            return self.device
        return torch.device("cuda", (self.device.index or 0) + rank)


def check_gpus(device: torch.device, size: int):
    """size GPUs from `device` on: tensor_parallel_size at most the visible GPUs."""
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + size > count:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs from cuda:{first}, this machine shows "
                         f"{count} (CUDA_VISIBLE_DEVICES); valid: 1 to {count - first}")


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Workers:
    """The driver's side of a tensor-parallel group: `tp` for its model, `device` its own, and the channel to the
    workers. `send` has them run an operation (the driver then runs its own), `everywhere` runs a function on every
    rank and returns the driver's result, `ask` returns the workers' results."""

    def __init__(self, tp: TensorParallel, device: torch.device, control, processes: list, threads: int):
        self.tp, self.device, self.control, self.processes = tp, device, control, processes
        self.is_running = True
        self.in_operation = False  # the driver runs its part of a sent operation: what it calls is mirrored already
        self.broken: str | None = None  # an operation that failed here other than as the workers' copies do
        self.threads = threads  # the process's torch threads before share_cores, restored at shutdown
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, spec: RankSpec, size: int) -> Workers:
        """Join (torchrun) or spawn the worker ranks and the process groups. Under torchrun a worker rank serves the
        driver here and then ends its process."""
        threads = torch.get_num_threads()
        if under_torchrun():
            tp, device, control = join_torchrun(spec, size)
            if tp.rank != 0:
                serve(spec, tp, device, control)
                dist.destroy_process_group()
                sys.exit(0)
            return cls(tp, device, control, [], threads)
        check_gpus(spec.device, size)
        if dist.is_initialized():
            raise ValueError("one tensor-parallel LLM per process at a time (its process group is the default one): "
                             "shutdown() the other first")
        with socket.socket() as sock:  # a free port for the group's rendezvous
            sock.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        context = torch.multiprocessing.get_context("spawn")
        processes = [context.Process(target=worker_main, args=(spec, rank, size, address, os.getpid()),
                                     name=f"flash-dllm-tp{rank}", daemon=True) for rank in range(1, size)]
        for process in processes:
            process.start()
        tp, device, control = join_group(spec, 0, size, address)
        return cls(tp, device, control, processes, threads)

    def ready(self, special):
        """After the driver built its shard: every rank's status (raising a worker's error here), and the driver's
        special tokens to the workers, which then start serving."""
        statuses = _exchange(self.control, self.tp.size, ("ok", special))
        failed = [(rank, message) for rank, (status, message) in enumerate(statuses) if status != "ok"]
        if failed:
            self.shutdown(notify=False)
            rank, message = failed[0]
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message}")

    def fail(self, error: BaseException):
        """The driver's construction failed: the workers stop at the status exchange."""
        try:
            _exchange(self.control, self.tp.size, ("failed", f"{type(error).__name__}: {error}"))
        finally:
            self.shutdown(notify=False)

    def send(self, fn: Callable, *args):
        """Every worker runs fn(its rank's state, *args); the caller then runs the driver's part (`operation`)."""
        self._broadcast((fn, args, False))

    @contextlib.contextmanager
    def operation(self, fn: Callable, *args):
        """Send fn to the workers, then run the driver's part in the block: the mirrored calls it makes are its own."""
        self.send(fn, *args)
        self.in_operation = True
        try:
            yield
        except ValueError:  # a request refused: the workers refused it too, at the same point
            raise
        except BaseException as error:  # an interrupt or a device error: a worker may wait in a collective
            self.broken = f"{fn.__name__} failed on rank 0 ({type(error).__name__})"
            raise
        finally:
            self.in_operation = False

    def everywhere(self, fn: Callable, llm, *args) -> Any:
        """fn(state, *args) on every rank, the driver's `llm` as its state: its result. fn must not use the
        driver's mirrored engine or runner (they would send operations the workers cannot take mid-call)."""
        self.send(fn, *args)
        return fn(llm, *args)

    def ask(self, fn: Callable, *args) -> list:
        """fn(state, *args) on the workers only: their results, rank 1 first (an exception raised there comes back
        as a RuntimeError)."""
        self._broadcast((fn, args, True))
        results = [None] * self.tp.size
        dist.gather_object(None, results, dst=0, group=self.control)
        for rank, result in enumerate(results[1:], start=1):
            if isinstance(result, BaseException):
                raise RuntimeError(f"tensor-parallel rank {rank}: {type(result).__name__}: {result}")
        return results[1:]

    def _broadcast(self, message):
        if not self.is_running:
            raise RuntimeError("the tensor-parallel workers have stopped")
        if self.broken:
            raise RuntimeError(f"the tensor-parallel ranks are out of step: {self.broken}; start a new LLM")
        dist.broadcast_object_list([message], src=0, group=self.control)

    def shutdown(self, notify: bool = True):
        """Stop the workers (they leave their loop), wait for the spawned ones and leave the process groups. Ranks out
        of step (`broken`) are not told: the spawned ones are terminated (torchrun ends its ranks when rank 0 fails)."""
        if not self.is_running:
            return
        self.is_running = False
        atexit.unregister(self.shutdown)
        try:
            if notify and not self.broken:
                dist.broadcast_object_list([None], src=0, group=self.control)
                dist.barrier(group=self.control)  # no rank tears its connections down while another reads (gloo aborts)
        finally:
            for process in self.processes:
                process.join(timeout=0 if self.broken else 30)
                if process.is_alive():
                    process.terminate()
            if dist.is_initialized() and not self.broken:  # a group mid-collective would wait for its peer
                dist.destroy_process_group()
            torch.set_num_threads(self.threads)


def join_group(spec: RankSpec, rank: int, size: int, address: str):
    """The process groups of a spawned group (rank 0 hosts the rendezvous at `address`)."""
    device = spec.device_of(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives use the current device
    else:
        share_cores(size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size)
    return _tensor_parallel(spec, rank, size), device, dist.new_group(backend="gloo", timeout=WAIT)


def join_torchrun(spec: RankSpec, size: int):
    """The process groups from torchrun's environment: its world is the tensor-parallel group."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"under torchrun, tensor_parallel_size ({size}) must equal the number of processes ({world})")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if spec.device.type == "cuda" else spec.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        share_cores(size)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return _tensor_parallel(spec, rank, size), device, dist.new_group(backend="gloo", timeout=WAIT)


def share_cores(size: int):
    """On the CPU the ranks share the machine's cores: each takes its share of torch's threads (the driver too).
    Oversubscribed, a rank's idle threads spin while it waits in a collective and starve the rank it waits for
    (2 ranks of 2 threads on 2 cores: steps 20x slower)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def _tensor_parallel(spec: RankSpec, rank: int, size: int) -> TensorParallel:
    return TensorParallel(rank, size, dist.group.WORLD, ordered=spec.batch_invariant)


def _exchange(control, size: int, status) -> list:
    statuses = [None] * size
    dist.all_gather_object(statuses, status, group=control)
    return statuses


# The workers.

def worker_main(spec: RankSpec, rank: int, size: int, address: str, parent: int):
    """A spawned worker's process: join the group, build the shard, serve the driver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver, which stops the workers
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    tp, device, control = join_group(spec, rank, size, address)
    serve(spec, tp, device, control)
    dist.destroy_process_group()


def _exit_with_parent(parent: int):
    """A worker whose driver died without stopping it (killed) would wait for it forever."""
    import time

    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


@dataclass
class RankState:
    """A worker's counterpart of the driver's LLM: what the operations read (the same attribute names)."""
    model: Any
    runner: ModelRunner
    device: torch.device
    dtype: torch.dtype
    special: Any = None
    engine: LLMEngine | None = None
    outputs: OrderedDict = dataclasses.field(default_factory=OrderedDict)  # request id -> tokens, the most recent

    @property
    def config(self):
        return self.model.config

    @property
    def tp(self) -> TensorParallel:
        return self.model.tp


def serve(spec: RankSpec, tp: TensorParallel, device: torch.device, control):
    """Build this worker's shard, report, then run the driver's operations until it stops."""
    from ..llm import build_rank

    try:
        model, runner = build_rank(spec, device, tp)
        status = ("ok", None)
    except Exception as error:
        status = ("failed", f"{type(error).__name__}: {error}")
    statuses = _exchange(control, tp.size, status)
    if any(s != "ok" for s, _ in statuses):
        return
    state = RankState(model, runner, device, spec.dtype, special=statuses[0][1])
    state.engine = LLMEngine(runner, state.special, spec.max_batch_size)
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        if message[0] is None:
            dist.barrier(group=control)
            return
        fn, args, reply = message[0]
        try:
            result = fn(state, *args)
        except Exception as error:  # the driver meets the same error in its own part (a rejected request)
            if not isinstance(error, ValueError):
                logger.warning("tensor-parallel rank %d: %s failed: %s: %s", tp.rank, fn.__name__,
                               type(error).__name__, error)
            result = error
        if reply:
            dist.gather_object(result, None, dst=0, group=control)


# The operations: module-level functions of (a rank's state, *args), run by every worker as the driver runs its own.

def add_request(state: RankState, prompt_ids: list[int], params):
    state.engine.add_request(prompt_ids, params)


def abort(state: RankState, request_ids: list[int]):
    engine, ids = state.engine, set(request_ids)
    engine.abort([seq for seq in [*engine.running, *engine.scheduler.waiting] if seq.request_id in ids])


def step(state: RankState, turn: tuple | None):
    state.engine.admit()
    for seq in state.engine.step_batch(turn):
        state.outputs[seq.request_id] = seq.output_ids
        if len(state.outputs) > RECENT_OUTPUTS:
            state.outputs.popitem(last=False)


def allocate_cache(state: RankState, with_hidden: bool):
    state.runner.allocate_cache(with_hidden)


def finished_tokens(state: RankState, request_ids: list[int]) -> list[list[int] | None]:
    """The tokens this rank generated for the requests (None: not among its recent outputs)."""
    return [state.outputs.get(request_id) for request_id in request_ids]


class MirroredRunner(ModelRunner):
    """The driver's runner: the KV cache's allocation (its size agreed over the ranks) is the workers' too."""

    def __init__(self, model, workers: Workers, **options):
        super().__init__(model, **options)
        self.workers = workers

    def allocate_cache(self, with_hidden: bool):
        if self.cache is not None or self.workers.in_operation:  # the workers' operation allocates theirs
            return super().allocate_cache(with_hidden)
        with self.workers.operation(allocate_cache, with_hidden):
            return super().allocate_cache(with_hidden)


class MirroredEngine(LLMEngine):
    """The driver's engine: each operation is sent to the workers before it runs here."""

    def __init__(self, runner: ModelRunner, special, max_batch_size: int, workers: Workers):
        super().__init__(runner, special, max_batch_size)
        self.workers = workers

    def add_request(self, prompt_ids: list[int], params):
        with self.workers.operation(add_request, list(prompt_ids), params):
            return super().add_request(prompt_ids, params)

    def abort(self, seqs):
        if self.workers.broken:  # the cleanup after the failure: the driver's own bookkeeping only
            return super().abort(seqs)
        with self.workers.operation(abort, [seq.request_id for seq in seqs]):
            super().abort(seqs)

    def step(self):
        # The turn is chosen here (by the steps' times, which differ between ranks) and sent with the step; the
        # admission before it is deterministic, so each worker's batches are the driver's.
        self.admit()
        turn = self.next_turn()
        with self.workers.operation(step, turn):
            return self.step_batch(turn)
