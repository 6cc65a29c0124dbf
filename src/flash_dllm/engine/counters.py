"""What a request may wait for besides its own work: kernel compiles, CUDA-graph captures, and long steps.

Counted process-wide, in total and per kernel or kind of graph (a data-parallel replica is a process of its own,
so its counts are its own):
- compiles: each new Triton kernel variant. On the GPU, each call of Triton's `JITFunction._do_compile` (a
  variant missing from the kernel's in-memory cache: compiled, or loaded from the disk cache), timed from the
  launch that found it missing to the launch's return (the launcher's build and the module's load included).
  Under TRITON_INTERPRET nothing compiles: the first launch of each variant key is counted instead, the key
  Triton would compile under (the constexpr values, each tensor's dtype and 16-byte alignment, each integer's
  width and whether it is 1 or a multiple of 16, unless the kernel marks it do_not_specialize; the launch
  options). So a CPU test sees which variants a request would compile on the GPU.
- captures: each CUDA graph captured (engine/cuda_graphs.py), with its host time (its eager first run
  included where the capture runs one).
- collections: each full collection of Python's cyclic garbage collector (its oldest generation), which stops the
  engine's thread while it traverses every tracked object (about 0.1 s for a tiny model's process on a slow CPU;
  a server freezes what its start-up left, engine/warmup.freeze_heap, so that later ones traverse only newer ones).
`ReadyMark` takes a baseline when a server (or a benchmark) reports ready: what is counted after it happened on
a request's path. `StepLog` keeps the engine's steps of the last minute (their time and `StepShape`); `StepTrace`
writes every step to a file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from typing import NamedTuple

log = logging.getLogger("flash_dllm.counters")
KINDS = ("compiles", "captures", "collections")


@dataclasses.dataclass(frozen=True)
class Tally:
    count: int = 0
    seconds: float = 0.0

    def __sub__(self, other: Tally) -> Tally:
        return Tally(self.count - other.count, self.seconds - other.seconds)


class Counters:
    """Process-wide tallies of compiles, captures and full collections: per kind, and per (kind, name)."""

    def __init__(self):
        self._lock = threading.RLock()  # a collection's count may be recorded by a thread already recording
        self._tallies = {kind: Tally() for kind in KINDS}
        self._by_name: dict[tuple[str, str], Tally] = {}

    def record(self, kind: str, seconds: float, name: str = ""):
        with self._lock:
            for table, key in ((self._tallies, kind), (self._by_name, (kind, name))):
                tally = table.get(key, Tally())
                table[key] = Tally(tally.count + 1, tally.seconds + seconds)

    def snapshot(self) -> dict[str, Tally]:
        with self._lock:
            return dict(self._tallies)

    def snapshot_by_name(self) -> dict[tuple[str, str], Tally]:
        with self._lock:
            return dict(self._by_name)

    @contextlib.contextmanager
    def timed(self, kind: str, name: str = ""):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(kind, time.perf_counter() - start, name)


COUNTERS = Counters()


class ReadyMark:
    """A baseline of COUNTERS: `after()` is what was counted since `mark()` (zero before it)."""

    def __init__(self, counters: Counters = COUNTERS):
        self.counters = counters
        self.baseline: dict[str, Tally] | None = None
        self.baseline_by_name: dict[tuple[str, str], Tally] = {}

    def mark(self):
        self.baseline, self.baseline_by_name = self.counters.snapshot(), self.counters.snapshot_by_name()

    def after(self) -> dict[str, Tally]:
        if self.baseline is None:
            return {kind: Tally() for kind in KINDS}
        now = self.counters.snapshot()
        return {kind: now[kind] - self.baseline[kind] for kind in KINDS}

    def after_by_name(self) -> dict[tuple[str, str], Tally]:
        """Per (kind, name): what was counted since `mark()`, the names with none left out; largest time first."""
        if self.baseline is None:
            return {}
        delta = {key: tally - self.baseline_by_name.get(key, Tally())
                 for key, tally in self.counters.snapshot_by_name().items()}
        return dict(sorted(((k, t) for k, t in delta.items() if t.count), key=lambda kt: -kt[1].seconds))


class StepShape(NamedTuple):
    """What an engine step's time is compared within: its method, batch size and work, the query rows its passes
    computed (full-depth rows, summed over the batch) rounded up to a quarter of an octave (`work_class`). A dLLM
    step's work varies by design: a first pass, a dual-cache block's full pass or an Elastic-Cache refresh computes
    a sequence's length of rows, a steady step a window. And how many of its rows route their prompt's keys
    (`kv_routing`): a routed pass launches the routing kernels and replays no pass graph, so beside dense requests
    whose steady passes replay, a routed request's steps are eager by design. A stall (a compile, a capture, an
    eager step among replayed ones) is a step slower than the others of its work."""

    method: str
    batch_size: int
    query_rows: int
    routed_rows: int = 0


def work_class(query_rows: int) -> int:
    """StepShape.query_rows of a step that computed `query_rows` rows: the next multiple of an eighth of the power
    of two at or above (four classes an octave, e.g. 129-160, 161-192, 193-224, 225-256), so that steps of one
    class differ by at most 1.25x in rows: Flash-Cache's steady window (144 rows) and a 64-token prompt's first
    pass (192) are told apart, as a power of two (256 for both) did not."""
    rows = max(query_rows, 1)
    step = max((1 << (rows - 1).bit_length()) // 8, 1)
    return -(-rows // step) * step


class StepLog:
    """The engine's steps of the last `window_s` seconds: (end time, seconds, shape)."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.steps: deque[tuple[float, float, StepShape]] = deque()
        self._lock = threading.Lock()  # the engine's thread records, /metrics reads

    def record(self, seconds: float, shape: StepShape, now: float | None = None):
        now = time.perf_counter() if now is None else now
        with self._lock:
            self.steps.append((now, seconds, shape))
            while self.steps and now - self.steps[0][0] > self.window_s:
                self.steps.popleft()

    def longest(self, now: float | None = None) -> tuple[float, float, int]:
        """(seconds of the longest step of the window, the largest ratio of a step to the median of its shape
        there, how many steps of that shape the window holds: a median of a few is noisy); (0, 0, 0) without
        steps."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            steps = [(seconds, shape) for end, seconds, shape in self.steps if now - end <= self.window_s]
        if not steps:
            return 0.0, 0.0, 0
        count, _, ratio = worst_shape(steps)
        return max(seconds for seconds, _ in steps), ratio, count


def worst_shape(steps: list[tuple[float, StepShape]]) -> tuple[int, float, float] | None:
    """step_ratios' entry of the shape whose longest step is furthest over its median; None without steps."""
    return max(step_ratios(steps).values(), key=lambda entry: entry[2], default=None)


def step_ratios(steps: list[tuple[float, StepShape]]) -> dict[StepShape, tuple[int, float, float]]:
    """steps: (seconds, shape) -> per shape, in order: (steps, median seconds, longest over median)."""
    by_shape: dict[StepShape, list[float]] = {}
    for seconds, shape in steps:
        by_shape.setdefault(shape, []).append(seconds)
    out = {}
    for shape, times in sorted(by_shape.items()):
        median = statistics.median(times)
        out[shape] = (len(times), median, max(times) / median if median > 0 else 0.0)
    return out


class StepTrace:
    """Every engine step as one JSON line (`serve --step-trace PATH`), for when /metrics' longest step is not
    enough to tell what made a step slow: when it ended (seconds after the first step), its wall seconds and the
    engine thread's CPU seconds in it (a step's wall beyond its CPU time is time the thread waited: for the GIL
    while the HTTP front runs Python, or in a sync that sleeps), how many garbage collections ran in it, its
    StepShape, its exact query rows, and the load (running and waiting requests after it, and the positions of the
    sequences it stepped: prompt + max_tokens)."""

    def __init__(self, path: str):
        self.file = open(path, "w", buffering=1)  # a line at a time: a killed server keeps what it traced
        self.origin: float | None = None
        self.cpu_start, self.collections = 0.0, 0  # at the step's start (`begin`)

    def begin(self):
        """Called as a step starts: the engine thread's CPU clock and the collections so far."""
        self.cpu_start, self.collections = time.thread_time(), _collections_so_far()

    def record(self, end: float, seconds: float, shape: StepShape, rows: int, running: int, waiting: int,
               positions: int):
        """The step begun last, as it ends at `end` after `seconds`."""
        self.origin = end if self.origin is None else self.origin
        self.file.write(json.dumps(dict(t=round(end - self.origin, 6), seconds=round(seconds, 6),
                                        cpu_seconds=round(time.thread_time() - self.cpu_start, 6),
                                        collections=_collections_so_far() - self.collections,
                                        **shape._asdict(), rows=rows, running=running, waiting=waiting,
                                        positions=positions)) + "\n")

    def close(self):
        self.file.close()


def _collections_so_far() -> int:
    """Garbage collections of any generation in this process so far."""
    return sum(generation["collections"] for generation in gc.get_stats())


# The hook into Python's garbage collector.

_collection_start: list[float] = []


def install_collection_hook():
    """Count full garbage collections into COUNTERS from now on (idempotent)."""
    if _count_full_collections not in gc.callbacks:
        gc.callbacks.append(_count_full_collections)


def _count_full_collections(phase: str, info: dict):
    if info.get("generation") != 2:
        return
    if phase == "start":
        _collection_start[:] = [time.perf_counter()]
    elif _collection_start:
        COUNTERS.record("collections", time.perf_counter() - _collection_start.pop(), "full")


# The hooks into Triton.

_installed: list[str] = []
_local = threading.local()


def install_compile_hooks() -> str:
    """Count compiles into COUNTERS from now on (idempotent): "triton" (the GPU path's _do_compile), "interpreter"
    (first launches of variant keys), or "none" (no Triton, or one without the method hooked: nothing counted)."""
    if _installed:
        return _installed[0]
    try:
        import triton  # noqa: F401
        from triton import knobs
    except ImportError:
        _installed.append("none")
        return "none"
    interpret = bool(knobs.runtime.interpret) if hasattr(knobs, "runtime") else False
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        _hook_interpreter(InterpretedFunction)
        _installed.append("interpreter")
        return "interpreter"
    from triton.runtime.jit import JITFunction
    if not hasattr(JITFunction, "_do_compile"):
        log.warning("this Triton has no JITFunction._do_compile: kernel compiles are not counted")
        _installed.append("none")
        return "none"
    _hook_jit(JITFunction)
    _installed.append("triton")
    return "triton"


def _hook_jit(jit_function):
    do_compile, run = jit_function._do_compile, jit_function.run

    def counted_do_compile(self, *args, **kwargs):
        _local.compiled = self.fn.__name__
        return do_compile(self, *args, **kwargs)

    def counted_run(self, *args, **kwargs):
        outer, _local.compiled = getattr(_local, "compiled", None), None
        start = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            if _local.compiled is not None:
                COUNTERS.record("compiles", time.perf_counter() - start, _local.compiled)
            _local.compiled = outer

    jit_function._do_compile, jit_function.run = counted_do_compile, counted_run


_seen_variants: set[tuple] = set()


def _hook_interpreter(interpreted_function):
    run = interpreted_function.run

    def counted_run(self, *args, grid, warmup, **kwargs):
        key = variant_key(self, args, kwargs)
        if key in _seen_variants:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        _seen_variants.add(key)
        start = time.perf_counter()
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:  # the first run of a variant stands for its compile
            COUNTERS.record("compiles", time.perf_counter() - start, self.fn.__name__)

    interpreted_function.run = counted_run


_parameters: dict = {}


def variant_key(function, args: tuple, kwargs: dict) -> tuple:
    """The key Triton (3.x) compiles a launch of `function` (an InterpretedFunction) under: per parameter its
    constexpr value, or its specialisation; and the launch options (num_warps, num_stages ...)."""
    fn = function.fn
    if fn not in _parameters:
        options = getattr(function, "kwargs", {}) or {}
        _parameters[fn] = (list(inspect.signature(fn).parameters.values()),
                           set(options.get("do_not_specialize") or ()),
                           set(options.get("do_not_specialize_on_alignment") or ()))
    params, no_value, no_alignment = _parameters[fn]
    bound = dict(zip((p.name for p in params), args))
    bound.update((k, v) for k, v in kwargs.items() if k not in bound)
    key = [fn.__module__, fn.__qualname__]
    for index, p in enumerate(params):
        value = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            key.append(("constexpr", _hashable(getattr(value, "value", value))))
        else:
            key.append(_specialisation(value, p.name in no_value or index in no_value,
                                       p.name in no_alignment or index in no_alignment))
    names = {p.name for p in params}
    key.append(tuple(sorted((k, _hashable(v)) for k, v in kwargs.items() if k not in names)))
    return tuple(key)


def _specialisation(value, no_value: bool, no_alignment: bool):
    if value is None:
        return None
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return ("tensor", str(value.dtype), no_alignment or value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("i1",)
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
        return (width,) if no_value else (width, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("fp32",)
    if isinstance(value, tuple):
        return tuple(_specialisation(v, no_value, no_alignment) for v in value)
    return (type(value).__name__, _hashable(value))


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of values; 0.0 for none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(max(math.ceil(q * len(ordered) - 1e-9) - 1, 0), len(ordered) - 1)]

