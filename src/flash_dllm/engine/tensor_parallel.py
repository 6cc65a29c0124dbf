"""Tensor parallelism's processes: the driver (rank 0, the user's process) and its worker ranks.

Every rank holds its shard of the model (models/parallel.py), its own runner, KV cache and engine, and runs every
engine operation that the driver runs, in the same order: add_request, abort, step and the KV cache's allocation.
The collectives inside the model give every rank bit-identical logits, attention mass and drift cosines, so every
rank takes the same decisions (the unmasking, Flash-Cache's query choice, Flash-Verify's acceptance, Elastic-Cache's
refresh, the engine's scheduling) and the engines stay in lockstep with no other exchange; the outputs are read on
the driver only. The driver sends each operation (a module-level function and its arguments, pickled) over a gloo
group before running it itself; a worker waits for the next one without a time limit. A decoding method that the
driver's program registered travels with each request (its class by reference: from a module, not a script).

Two ways to start: `LLM(..., tensor_parallel_size=N)` starts N - 1 worker processes (`python -m
flash_dllm.engine.worker`: fresh interpreters that never import the user's script; one per GPU: cuda:i + rank from
the driver's cuda:i); under `torchrun --nproc-per-node N` rank 0 is the driver and the other ranks' `LLM(...)` serve
it and then end their process.

No rank waits for a dead one. The driver watches its workers until they have joined (one that exits first fails the
start at once, naming its rank), and a rank that ends later closes its connections: the driver's next collective
fails (on gloo at once; NCCL's wait ends at the group's timeout, JOIN) with an error naming it. A worker whose part
of an operation failed leaves (logging one line) rather than leave the driver waiting in a collective; a worker
whose driver vanished ends quietly; SIGTERM to the driver ends its workers with it.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from ..decoding.registry import METHODS, method_of, register
from ..models.parallel import TensorParallel
from .llm_engine import LLMEngine
from .model_runner import ModelRunner
from .rank import RankSpec, build_rank

logger = logging.getLogger("flash_dllm")
WAIT = timedelta(days=365)    # a worker waits this long for the driver's next operation (a server may idle)
JOIN = timedelta(minutes=10)  # the workers' start up to the rendezvous; each connection, each model collective
RECENT_OUTPUTS = 4096         # a worker keeps the tokens of this many finished requests (checked by tests)
WORKER_MODULE = "flash_dllm.engine.worker"  # what a worker's process runs (`python -m`)
JOINING = "flash_dllm/joining/"  # + rank: a worker's key in the rendezvous store, set as it enters the rendezvous
LOST_WAIT_S = 2.0  # a worker's connections close just before its exit shows: how long a failed collective looks


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


class WorkerProcess:
    """A worker rank's process (`python -m` WORKER_MODULE), its arguments pickled on its stdin. Its stderr goes through
    to the driver's; the last line is kept for the error that reports its exit."""

    def __init__(self, spec: RankSpec, rank: int, size: int, port: int):
        self.rank, self.last_line = rank, ""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the driver's modules, as a spawned process's
        self.popen = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env)
        self.forwarding = threading.Thread(target=self._forward_stderr, name=f"flash-dllm-tp{rank}-stderr",
                                           daemon=True)
        self.forwarding.start()
        try:
            self.popen.stdin.write(pickle.dumps((spec, rank, size, port, os.getpid())))
            self.popen.stdin.close()
        except BrokenPipeError:  # it has exited already: the driver reports why
            pass

    def _forward_stderr(self):
        for line in self.popen.stderr:
            text = line.decode(errors="replace")
            sys.stderr.write(text)
            sys.stderr.flush()
            if text.strip():
                self.last_line = text.strip()

    def exit_reason(self, when: str = "") -> str | None:
        """Why it ended, in one line (`when`: e.g. " before joining"); None while it runs."""
        code = self.popen.poll()
        if code is None:
            return None
        self.forwarding.join(timeout=1.0)  # its last words
        how = f"was killed by signal {-code} ({signal.strsignal(-code)})" if code < 0 else f"exited with code {code}"
        return f"tensor-parallel rank {self.rank} {how}{when}" + (f": {self.last_line}" if self.last_line else "")

    def stop(self, grace: float):
        """Wait up to `grace` seconds for it to end, then terminate it (and kill it if that fails)."""
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.popen.terminate()
            try:
                self.popen.wait(5.0)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def lost_workers(processes: list[WorkerProcess], wait: float, when: str = "") -> str | None:
    """The workers that have ended, in one line, waiting up to `wait` seconds for one; None if none has."""
    deadline = time.monotonic() + wait
    while True:
        reasons = [reason for process in processes if (reason := process.exit_reason(when))]
        if reasons or time.monotonic() >= deadline:
            return "; ".join(reasons) or None
        time.sleep(0.05)


class Workers:
    """The driver's side of a tensor-parallel group: `tp` for its model, `device` its own, and the channel to the
    workers. `send` has them run an operation (the driver then runs its own), `everywhere` runs a function on every
    rank and returns the driver's result, `ask` returns the workers' results."""

    def __init__(self, tp: TensorParallel, device: torch.device, control, processes: list[WorkerProcess],
                 threads: int):
        self.tp, self.device, self.control, self.processes = tp, device, control, processes
        self.is_running = True
        self.in_operation = False  # the driver runs its part of a sent operation: what it calls is mirrored already
        self.broken: str | None = None  # why the ranks are out of step (a failed operation, a worker that ended)
        self.threads = threads  # the process's torch threads before share_cores, restored at shutdown
        if processes and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a handler of the program's own stays
            signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, spec: RankSpec, size: int) -> Workers:
        """Join (torchrun) or start the worker ranks and the process groups. Under torchrun a worker rank serves the
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
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=JOIN)
        processes = [WorkerProcess(spec, rank, size, store.port) for rank in range(1, size)]
        try:
            device = take_device(spec.device_of(0), size)
            await_workers(store, processes)
            tp, control = join_group(spec, 0, size, store)
        except BaseException as error:  # a worker that ended (named), an interrupt, the rendezvous's timeout
            lost = lost_workers(processes, LOST_WAIT_S, " before joining") if isinstance(error, RuntimeError) else None
            for process in processes:
                process.stop(grace=0)
            torch.set_num_threads(threads)
            if lost:
                raise RuntimeError(lost) from None
            raise
        return cls(tp, device, control, processes, threads)

    def ready(self, special):
        """After the driver built its shard: every rank's status (raising a worker's error here), and the driver's
        special tokens to the workers, which then start serving."""
        try:
            statuses = _exchange(self.control, self.tp.size, ("ok", special))
        except RuntimeError as error:
            try:
                self._raise_out_of_step(error, "the start")
            finally:
                self.shutdown(notify=False)
        failed = [(rank, message) for rank, (status, message) in enumerate(statuses) if status != "ok"]
        if failed:
            self.shutdown(notify=False)
            rank, message = failed[0]
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message}")

    def fail(self, error: BaseException):
        """The driver's construction failed: the workers stop at the status exchange (interrupted: at once)."""
        try:
            if not isinstance(error, Exception):  # a worker may still be loading its shard: not waited for
                self.broken = f"the start was interrupted ({type(error).__name__})"
            else:
                _exchange(self.control, self.tp.size, ("failed", f"{type(error).__name__}: {error}"))
        except RuntimeError:  # a worker has ended: the driver's own error is the one raised
            self.broken = "a worker ended during the start"
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
        except BaseException as error:  # an interrupt, a device error, a worker that ended: the ranks are out of step
            self._raise_out_of_step(error, fn.__name__)
        finally:
            self.in_operation = False

    def everywhere(self, fn: Callable, llm, *args) -> Any:
        """fn(state, *args) on every rank, the driver's `llm` as its state: its result. fn must not use the
        driver's mirrored engine (it would send operations the workers cannot take mid-call)."""
        with self.operation(fn, *args):
            return fn(llm, *args)

    def ask(self, fn: Callable, *args) -> list:
        """fn(state, *args) on the workers only: their results, rank 1 first (an exception raised there comes back
        as a RuntimeError)."""
        self._broadcast((fn, args, True))
        results = [None] * self.tp.size
        try:
            dist.gather_object(None, results, dst=0, group=self.control)
        except RuntimeError as error:
            self._raise_out_of_step(error, fn.__name__)
        for rank, result in enumerate(results[1:], start=1):
            if isinstance(result, BaseException):
                raise RuntimeError(f"tensor-parallel rank {rank}: {type(result).__name__}: {result}")
        return results[1:]

    def _broadcast(self, message):
        if not self.is_running:
            raise RuntimeError("the tensor-parallel workers have stopped")
        if self.broken:
            raise RuntimeError(f"the tensor-parallel ranks are out of step: {self.broken}; start a new LLM")
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except RuntimeError as error:  # not sent (a message that does not pickle raises other errors, before it)
            self._raise_out_of_step(error, message[0].__name__)

    def _raise_out_of_step(self, error: BaseException, what: str) -> NoReturn:
        """`what` failed on the driver with `error`: the ranks are out of step. Raises the workers that ended, in
        one line, if the failure (a collective's RuntimeError) was theirs, else `error`."""
        lost = lost_workers(self.processes, LOST_WAIT_S) if isinstance(error, RuntimeError) else None
        self.broken = lost or f"{what} failed on rank 0 ({type(error).__name__})"
        if lost:
            raise RuntimeError(lost) from None
        raise error

    def _on_sigterm(self, signum, frame):
        """SIGTERM ends the workers (at once, by their default action) and then the driver, as without them."""
        for process in self.processes:
            process.popen.terminate()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def shutdown(self, notify: bool = True):
        """Stop the workers (they leave their loop), wait for the started ones and leave the process groups. Ranks out
        of step (`broken`) are not told: the started ones are terminated (torchrun ends its ranks when rank 0 fails)."""
        if not self.is_running:
            return
        self.is_running = False
        atexit.unregister(self.shutdown)
        in_main_thread = threading.current_thread() is threading.main_thread()
        if in_main_thread and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            if notify and not self.broken:
                dist.broadcast_object_list([None], src=0, group=self.control)
                dist.barrier(group=self.control)  # no rank tears its connections down while another reads (gloo aborts)
        except RuntimeError as error:  # a worker has ended: the others are stopped below
            self.broken = lost_workers(self.processes, LOST_WAIT_S) or f"shutdown failed on rank 0 ({error})"
            logger.warning("tensor-parallel shutdown: %s", self.broken)
        finally:
            for process in self.processes:
                process.stop(grace=0 if self.broken else 30)
            # On the GPU a collective of ranks out of step may still wait for its peer: that group is left as it is
            if dist.is_initialized() and (not self.broken or self.device.type == "cpu"):
                dist.destroy_process_group()
            torch.set_num_threads(self.threads)


def await_workers(store, processes: list[WorkerProcess]):
    """Wait until every worker has entered the rendezvous; one that exits first, or stays away JOIN, fails here."""
    keys, deadline = [f"{JOINING}{process.rank}" for process in processes], time.monotonic() + JOIN.total_seconds()
    while not store.check(keys):
        lost = lost_workers(processes, 0.0, " before joining")
        if lost:
            raise RuntimeError(lost)
        if time.monotonic() > deadline:
            absent = [process.rank for process in processes if not store.check([f"{JOINING}{process.rank}"])]
            raise RuntimeError(f"tensor-parallel rank {absent[0]} did not join within {JOIN.total_seconds():.0f} s")
        time.sleep(0.05)


def take_device(device: torch.device, size: int) -> torch.device:
    """A rank's device: its GPU, current for NCCL's collectives; on the CPU, its share of the cores."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        share_cores(size)
    return device


def join_group(spec: RankSpec, rank: int, size: int, store) -> tuple[TensorParallel, Any]:
    """The process groups of a started group (rank 0 hosts the rendezvous `store`): the model's, the control's."""
    backend = "nccl" if spec.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=JOIN)
    return _tensor_parallel(spec, rank, size), dist.new_group(backend="gloo", timeout=WAIT)


def join_torchrun(spec: RankSpec, size: int):
    """The process groups from torchrun's environment: its world is the tensor-parallel group."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"under torchrun, tensor_parallel_size ({size}) must equal the number of processes ({world})")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = take_device(torch.device("cuda", local_rank) if spec.device.type == "cuda" else spec.device, size)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return _tensor_parallel(spec, rank, size), device, dist.new_group(backend="gloo", timeout=WAIT)


def share_cores(size: int):
    """On the CPU the ranks share the machine's cores: each takes its share of torch's threads (the driver too).
    Oversubscribed, a rank's idle threads spin while it waits in a collective and starve the rank it waits for
    (2 ranks of 2 threads on 2 cores: steps 20x slower)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def _tensor_parallel(spec: RankSpec, rank: int, size: int) -> TensorParallel:
    return TensorParallel(rank, size, dist.group.WORLD, ordered=spec.batch_invariant,
                          expert_parallel=spec.expert_parallel)


def _exchange(control, size: int, status) -> list:
    statuses = [None] * size
    dist.all_gather_object(statuses, status, group=control)
    return statuses


# The workers.

def worker_main(spec: RankSpec, rank: int, size: int, port: int, parent: int):
    """A started worker's process (engine/worker.py): join the group, build the shard, serve the driver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver, which stops the workers
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=JOIN)
    device = take_device(spec.device_of(rank), size)
    store.set(f"{JOINING}{rank}", "")  # the driver enters the rendezvous once every worker has
    tp, control = join_group(spec, rank, size, store)
    serve(spec, tp, device, control, parent)
    dist.destroy_process_group()


def _exit_with_parent(parent: int):
    """A worker whose driver died without stopping it (killed) would wait for it forever."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _driver_gone(parent: int | None) -> bool:
    """Whether a started worker's driver has ended (its connections close just before that shows); under torchrun
    (parent None) unknown: its agent ends the other ranks when rank 0 fails."""
    deadline = time.monotonic() + LOST_WAIT_S
    while parent is not None:
        if os.getppid() != parent:
            return True
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return False


def _next_operation(control, rank: int, parent: int | None) -> tuple | None:
    """The driver's next operation (None: stop). The worker ends here if the channel broke (the driver ended: quietly)
    or the operation does not unpickle here (a function or class of the driver's __main__)."""
    message = [None]
    try:
        dist.broadcast_object_list(message, src=0, group=control)
    except RuntimeError:
        os._exit(1)
    except Exception as error:
        _leave(f"tensor-parallel rank {rank} cannot take the driver's operation: {type(error).__name__}: {error}",
               parent)
    return message[0]


@contextlib.contextmanager
def _from_driver():
    """A collective of the control channel: the worker ends here, quietly, if it broke (the driver ended)."""
    try:
        yield
    except RuntimeError:
        os._exit(1)


def _leave(message: str, parent: int | None):
    """End a worker out of step with its driver: its one line, unless the driver has ended (then the cause)."""
    if not _driver_gone(parent):
        logger.error(message)
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


def serve(spec: RankSpec, tp: TensorParallel, device: torch.device, control, parent: int | None = None):
    """Build this worker's shard, report, then run the driver's operations until it stops (parent: a started
    worker's driver, None under torchrun). A worker whose part of an operation failed leaves, so that the driver's
    collectives fail instead of waiting for it."""
    try:
        model, runner = build_rank(spec, device, tp)
        status = ("ok", None)
    except Exception as error:
        status = ("failed", f"{type(error).__name__}: {error}")
    with _from_driver():
        statuses = _exchange(control, tp.size, status)
    if any(s != "ok" for s, _ in statuses):
        return
    state = RankState(model, runner, device, spec.dtype, special=statuses[0][1])
    state.engine = LLMEngine(runner, state.special, spec.max_batch_size)
    while (message := _next_operation(control, tp.rank, parent)) is not None:
        fn, args, reply = message
        try:
            result = fn(state, *args)
        except ValueError as error:  # a request refused: the driver refuses it too, at the same point
            result = error
        except Exception as error:  # out of step: leaving fails the driver's collectives rather than hang them
            if not reply:
                _leave(f"tensor-parallel rank {tp.rank}: {fn.__name__} failed: {type(error).__name__}: {error}", parent)
            result = error  # an asked function's (it runs no collectives): the driver raises it
        if reply:
            with _from_driver():
                dist.gather_object(result, None, dst=0, group=control)
    with _from_driver():
        dist.barrier(group=control)


# The operations: module-level functions of (a rank's state, *args), run by every worker as the driver runs its own.

def add_request(state: RankState, prompt_ids: list[int], params, method: type):
    if params.method not in METHODS:  # one the driver's program registered: its class comes by reference
        register(method)
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
        with self.workers.operation(add_request, list(prompt_ids), params, type(method_of(params.method))):
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
