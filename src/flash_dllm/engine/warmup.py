"""Compile every Triton kernel variant of the cached passes when the KV cache is allocated, not mid-run.

Triton compiles a kernel at its first launch with each new set of compile-time constants, and the kernels
choose their tile sizes by row count. A step whose row count enters a new size class (a batch that shrinks
as its requests finish, a verify pass that grows) would otherwise compile in the middle of decoding, at
0.1-1 s a variant: measured on the H200, the first sweep points of a method ran 5-20x slow. One pass per
row-count class and pass kind reaches them all, through the first layer only: every layer launches the same
variants (the same shapes, strides and alignments). Each is run dense and with routed prompt keys (the routed
attention's own tilings and key splits), and a routed pass over each power of two of chunks reaches the
routing kernels' variants (one per power of two of a pass's chunk count).

The compiles run in parallel. A first sweep runs the passes without launching any Triton kernel: each new
variant's compile goes to a thread pool once (triton.AsyncCompileMode, keyed as Triton keys its variants: the
constants and the arguments' specialisations; Triton releases the GIL in its MLIR and LLVM passes and runs
ptxas and the C compiler of its launchers as subprocesses). A second sweep then runs the passes, loading what was
compiled. Triton's disk cache serves later processes. H200, LLaDA-8B: the 122 passes launch 34 variants, compiled
in 6.4 s on 16 threads (one at a time through every layer: about 30 s).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..cache.attention_metadata import AttentionMetadata, FlatRows, device_tensor
from ..cache.kv_cache import KVCache
from ..cache.routing import CHUNK, PromptRouting
from ..kernels.flash_attention import packed_from
from ..kernels.greedy_tokens import greedy_tokens
from .counters import install_collection_hook, install_compile_hooks
from .cuda_graphs import bucket

install_compile_hooks()  # every compile from here on is counted (engine/counters.py), the warm-up's included
install_collection_hook()  # and every full garbage collection

# One row count per tile-size class of the kernels' launch configurations (by total and per-request rows),
# each as one request and as several (the attention kernel's verify tiles depend on the batch too).
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REQUEST_COUNTS = (1, 8)
# Each pass also runs over this many keys (at most the cache's rows): few requests then split their keys across
# programs, variants of the attention kernel of their own (kernels/flash_attention.py, SPLIT_MIN_KEYS).
LONG_KV = 8192
PASS_KINDS = ("write", "track", "verify")  # writes the cache; also sums the key mass; writes none (own keys)
# The routed passes' policies: the routing kernels' two kinds of scored unit (KMEANS: regions; else chunks), and
# a budget that opens some chunks, not all.
ROUTED_POLICIES, ROUTED_BUDGET = ("chunk", "kmeans"), 0.125
# A thread per core: LLaDA-8B's passes launch 34 variants (H200), so more than 32 threads would idle.
COMPILE_THREADS = min(32, os.cpu_count() or 1)
# A warm disk cache serves every variant sooner (H200, LLaDA-8B: no report in a second process); compiles that
# outlast it are reported.
QUIET_S = 2.0

# model -> the modes (batch-invariant or not) whose variants are compiled in this process
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def compile_kernels(model, cache: KVCache, row_counts: tuple[int, ...] = ROW_COUNTS,
                    request_counts: tuple[int, ...] = REQUEST_COUNTS, ordered: bool = False, routed: bool = False):
    """Run the three kinds of cached pass (cache write; with tracked rows; verify, which writes no cache)
    through the kernels for each number of requests and rows per request, over as many keys as rows and over
    LONG_KV, on the first cache rows (shared by the requests). ordered: the batch-invariant mode's variants.
    Then the greedy sampler once over the vocabulary. routed: also the routed passes (`cached_passes`), which
    allocate the routing's summaries beside the cache (a server's, whose any request may route; not a `generate`
    that routes nothing). On the GPU the variants are compiled in parallel first. Call before any sequence holds
    cache rows."""
    done = _compiled.setdefault(model, set())
    parts = [part for part in ("dense", "routed") if (ordered, part) not in done
             and (part == "dense" or routed and not ordered)]  # routing is not batch-invariant: refused there
    if not parts:
        return
    packed = packed_from(model.shard_config.num_heads, model.shard_config.num_kv_heads)
    if cache.k[0].is_cuda and packed is not None:  # where compiles happen: also the packed launches
        request_counts = (*request_counts, packed)
    passes = cached_passes(model, cache, row_counts, sorted(set(request_counts)), ordered, parts)
    with first_layer_only(model):
        if cache.k[0].is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            try:
                compile_in_parallel(passes)
            except Exception as error:  # e.g. a Triton without AsyncCompileMode: the sweep below compiles
                print(f"flash-dllm: warning: parallel kernel compiles failed ({type(error).__name__}: {error}); "
                      f"compiling one at a time", file=sys.stderr)
        for run in passes:
            run()
    done.update((ordered, part) for part in parts)


def cached_passes(model, cache: KVCache, row_counts: tuple[int, ...], request_counts: tuple[int, ...],
                  ordered: bool, parts: list[str]) -> list:
    """compile_kernels' passes, each a call without arguments. parts: "dense" (the passes and the sampler),
    "routed" (each row-count class and pass kind routed over the long keys: the routed tiles, splits and key mass;
    and one routed pass per power of two of chunks up to the cache's rows, for each kind of routing kernel)."""
    device = cache.k[0].device
    long_kv = min(cache.num_rows, LONG_KV)
    shapes = [(rows, requests) for rows, requests in itertools.product(row_counts, request_counts)
              if rows <= cache.num_rows]
    passes = []
    if "dense" in parts:
        passes += [functools.partial(cached_pass, model, cache, rows, requests, kv, kind, ordered)
                   for rows, requests in shapes for kv in sorted({rows, max(rows, long_kv)}) for kind in PASS_KINDS]
        for dtype in {torch.float32, cache.dtype}:  # the sampler's: full passes' fp32 logits, cached passes' own
            passes.append(functools.partial(greedy_tokens, torch.zeros(1, model.config.vocab_size, dtype=dtype,
                                                                       device=device), mask_id=0))
    if "routed" in parts:
        passes += [functools.partial(cached_pass, model, cache, rows, requests, long_kv, kind, ordered, "chunk")
                   for rows, requests in shapes if rows < long_kv for kind in PASS_KINDS]
        chunk_counts = [CHUNK << i for i in range(cache.num_rows.bit_length()) if CHUNK << i < cache.num_rows]
        passes += [functools.partial(cached_pass, model, cache, 1, 1, kv, "write", ordered, policy)
                   for kv in [*chunk_counts, cache.num_rows] if kv > 1 for policy in ROUTED_POLICIES]
    return passes


def cached_pass(model, cache: KVCache, rows: int, requests: int, kv: int, kind: str, ordered: bool,
                policy: str | None = None):
    """One cached pass of `kind` over `rows` query rows for each of `requests` requests, each reading `kv` keys of
    the first cache rows. policy: the requests' prompts (all but the rows) are routed by it; the rows are then
    the last positions, generated ones (a pass with prompt rows reads every key)."""
    device = cache.k[0].device
    zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=device)
    n = rows * requests
    first = kv - rows if policy else 0
    ids, positions = zeros(n, dtype=torch.long), torch.arange(first, first + rows, device=device).repeat(requests)
    flat = FlatRows.from_counts([rows] * requests, device)
    options, key_mass = {}, None
    if kind == "track":
        options, key_mass = dict(track_rows=torch.ones(n, dtype=torch.bool, device=device)), zeros(requests, kv)
    elif kind == "verify":
        options = dict(write_cache=False, hidden_keys=zeros(requests, kv, dtype=torch.bool),
                       self_visibility=torch.ones(requests, rows, rows, dtype=torch.bool, device=device))
    if policy:
        upload = lambda values: device_tensor(values, device)
        options["routing"] = PromptRouting.build(
            [first] * requests, [kv] * requests, [rows] * requests, kind != "verify", [ROUTED_BUDGET] * requests,
            [policy] * requests, flat.request, positions, upload(list(range(requests))),
            zeros(requests, dtype=torch.long), zeros(requests, dtype=torch.long), upload)
    metadata = AttentionMetadata.build(flat, zeros(requests, dtype=torch.long),
                                       torch.full((requests,), kv, device=device), positions, kv, ordered=ordered,
                                       **options)
    model.forward_cached(ids, positions, metadata, cache, key_mass=key_mass, kernels=True)


@contextlib.contextmanager
def first_layer_only(model):
    layers = model.layers
    model.layers = layers[:1]
    try:
        yield
    finally:
        model.layers = layers


def compile_in_parallel(passes: list):
    """Every variant the passes launch, compiled once each on COMPILE_THREADS threads; no kernel is launched."""
    import triton
    from triton.runtime.jit import JITFunction

    # A failed compile is left to the second sweep, which raises its error where it belongs.
    with (_CompilePool(COMPILE_THREADS) as pool, triton.AsyncCompileMode(pool, ignore_errors=True),
          _compile_only(JITFunction)):
        progress = CompileProgress(pool.futures)
        for run in passes:
            run()
            progress.update()
        progress.wait()


class _CompilePool(ThreadPoolExecutor):
    """A thread pool that keeps the futures of what it runs: one per variant (AsyncCompileMode submits each once).
    It also builds each variant's launcher: Triton (3.6) compiles a C launcher per argument signature with the
    host's C compiler at the variant's first launch, which would otherwise run one at a time on the main thread
    (kept in the disk cache, where that launch finds it)."""

    def __init__(self, threads: int):
        super().__init__(threads, thread_name_prefix="triton-compile")
        self.futures: list[Future] = []
        self._signatures: set[tuple] = set()
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = super().submit(self._compile, fn, *args, **kwargs)
        self.futures.append(future)
        return future

    def _compile(self, fn, *args, **kwargs):
        from triton.runtime import driver

        kernel = fn(*args, **kwargs)
        signature = tuple(kernel.src.signature.values())  # all a launcher's source depends on
        with self._lock:
            new = signature not in self._signatures
            self._signatures.add(signature)
        if new and hasattr(driver.active, "launcher_cls"):
            driver.active.launcher_cls(kernel.src, kernel.metadata)
        return kernel


@contextlib.contextmanager
def _compile_only(jit_function):
    """Launches of Triton kernels only compile them (under AsyncCompileMode: hand the compile to the pool) and launch
    nothing: their outputs stay unwritten, which no host decision of a pass reads. The engine's thread is the only
    one launching kernels while the cache is allocated."""
    run = jit_function.run
    jit_function.run = lambda self, *args, grid, warmup, **kwargs: run(self, *args, grid=grid, warmup=True, **kwargs)
    try:
        yield
    finally:
        jit_function.run = run


class CompileProgress:
    """The compiles of `futures` on stderr: nothing while a warm disk cache could still be serving them (quiet_s),
    then a line and a bar that advances per variant (its total grows while the passes still find variants)."""

    def __init__(self, futures: list[Future], quiet_s: float = QUIET_S):
        self.futures, self.quiet_until, self.bar = futures, time.perf_counter() + quiet_s, None

    def update(self):
        done = sum(future.done() for future in self.futures)
        if self.bar is None:
            if done == len(self.futures) or time.perf_counter() < self.quiet_until:
                return
            print("flash-dllm: compiling the cached passes' kernel variants (first run with this Triton cache; later "
                  "processes load them from it)", file=sys.stderr, flush=True)
            self.bar = tqdm(total=len(self.futures), unit="variant", file=sys.stderr)
        self.bar.total = len(self.futures)
        self.bar.update(done - self.bar.n)

    def wait(self):
        """Until every compile is done."""
        pending = [future for future in self.futures if not future.done()]
        wait(pending, timeout=max(0.0, self.quiet_until - time.perf_counter()))
        self.update()
        for _ in as_completed(pending):
            self.update()
        if self.bar is not None:
            self.bar.close()


# Requests before ready: what compile_kernels' synthetic passes do not reach (each method's own launches and
# phases: full passes, Elastic-Cache's drift test and refreshes, Flash-Verify's views, routed first passes and their
# chunk summaries). Which variants a request launches depends on its method, routing, phase and batch, not on its
# prompt's length (which only picks among the row and key classes compile_kernels runs). Measured on the
# H100 (random LLaDA-8B, benchmarks/warm_up_anatomy.py): of 612 warm-up requests over 7 prompt lengths, alone and
# batched, only the first call of a method and routing launched a variant compile_kernels had not (and none of an
# uncached method, whose passes are full passes); so each runs the shortest prompt alone, then every length (the
# longest that fits) twice in one batch (without that batch, the interpreted mix of tests/bench/test_mix.py meets a
# new variant). An uncached method runs the shortest only: a long prompt's full passes
# compute fp32 logits over the vocabulary at every position, the warm-up's costliest calls, for no new variant.
WARM_UP_PROMPT_LENGTHS = (64, 8192)
WARM_UP_MAX_TOKENS = (32,)
# The routing kernels read a request's policy as data, except k-means, which launches its own (its regions): a
# chunk-scored policy stands for the others (centroid, window, random launch the same variants).
WARM_UP_ROUTINGS = (None, *ROUTED_POLICIES)


def warm_up_requests(llm, methods: tuple[str, ...] | None = None,
                     routings: tuple[str | None, ...] = WARM_UP_ROUTINGS,
                     prompt_lengths: tuple[int, ...] = WARM_UP_PROMPT_LENGTHS,
                     max_tokens: tuple[int, ...] = WARM_UP_MAX_TOKENS, block_length: int = 32) -> int:
    """Run, through the first layer only and without CUDA graphs, requests of each method (default: every one
    this model runs), routing (cached methods only) and generation length: the shortest of `prompt_lengths`
    alone, then each (or the longest the model and the cache hold; an uncached method: the shortest) twice in
    one batch, of random token ids. The kernel variants they launch are compiled (loaded) here, not on a request's
    path; every layer launches the variants of the first. Returns how many requests ran. Call once the KV cache
    is allocated (`allocate_cache`)."""
    from ..decoding.registry import METHODS, method_of
    from ..sampling_params import SamplingParams

    methods = tuple(METHODS) if methods is None else methods
    runner, engine = llm.runner, llm.engine
    rows = runner.cache.num_rows if runner.cache is not None else llm.config.max_position
    specials = {*llm.special.stop_ids, llm.special.mask_id}
    ids = [i for i in range(16, 16 + 97 + len(specials)) if i not in specials][:97]  # ordinary tokens, any model
    ran, kind = 0, llm.config.attention.kind
    cached = [method_of(m, kind) for m in methods if method_of(m, kind).uses_cache]
    if cached:  # allocated now, not under the warm-up: the graphs it makes are set aside with the others
        runner.allocate_cache(with_hidden=any(method.caches_hidden_states for method in cached))
    graphs, runner.graphs = runner.graphs, None  # a 1-layer capture would replay wrong later
    try:
        with first_layer_only(llm.model):
            for method, routing, tokens in itertools.product(methods, routings, max_tokens):
                if routing is not None and not method_of(method, kind).uses_cache:
                    continue
                try:
                    params = SamplingParams(method=method, max_tokens=tokens, block_length=min(block_length, tokens),
                                            kv_routing=routing)
                except ValueError:  # e.g. a generation length its blocks do not divide
                    continue
                longest = min(rows, llm.config.max_position) - tokens
                lengths = sorted({n for n in (min(n, longest) for n in prompt_lengths)
                                  if n > 0 and _fits(engine, n, params)})
                if not method_of(method, kind).uses_cache:  # full passes only: the cost of a long prompt, no variant
                    lengths = lengths[:1]
                prompts = [[ids[i % len(ids)] for i in range(n)] for n in lengths]
                for batch in [prompts[:1], prompts * 2] if prompts else []:  # alone, and several in one batch
                    llm.generate(batch, params, use_tqdm=False)
                    ran += len(batch)
    finally:
        runner.graphs = graphs
    return ran


# After ready a request's steps run eagerly (no whole-step graph is captured then, and none captured before fits a
# later batch: engine/cuda_graphs.py), but a pass replays any graph of its shape. The steady passes of the methods
# that declare one (`DecodingMethod.steady_pass`: Flash-Cache's budget, dual-cache's block) are captured before
# ready for these batch sizes and every bucket of the keys' width (model_runner.prepare); a batch's other passes
# (first passes, refreshes, other batch sizes or settings) run eagerly. Each batch size (`serve
# --graph-batch-sizes`) costs start-up: one graph per method and bucket (~20 a method, ~70 ms each on an H100).
# Batch 2 is the default's second: at low load the most frequent batch after 1, whose steady step replayed took
# 16 ms against 22.5 ms eager (benchmarks/HISTORY.md, session 34).
STEADY_BATCH_SIZES = (1, 2)


def compiles_on_first_use(runner) -> bool:
    """Whether a pass's first launch compiles (Triton kernels on CUDA): what the warm-ups are for."""
    return runner.kernels and runner.device.type == "cuda"


def warm_up_routing(kv_routing: str | None) -> str | None:
    """The warm-up routing that launches a request's routing variants: k-means its own, any other policy chunks'."""
    return kv_routing if kv_routing in (None, "kmeans") else "chunk"


def key_widths(first: int, last: int) -> list[int]:
    """The buckets of the keys' width (cuda_graphs.bucket) that lengths first..last reach, in order."""
    widths, n = [], first
    while n <= last:
        widths.append(bucket(n))
        n = widths[-1] + 1
    return widths


def capture_steady_passes(llm, methods: tuple[str, ...], block_length: int = 32,
                          batch_sizes: tuple[int, ...] = STEADY_BATCH_SIZES) -> int:
    """Capture the CUDA graphs of the steady passes of `methods` (with their default settings and `block_length`)
    over `batch_sizes` requests, at every bucket of the keys' width that a sequence the cache and the model hold
    reaches: each pass runs twice on a synthetic batch (a graph is captured at its shape's second sighting). The
    batch's rows are the cache's first; what the passes write there, before ready, no request reads. Sizes past the
    engine's largest batch are skipped. Returns how many shapes were captured."""
    from ..batch import Counters, DecodeBatch, RowState
    from ..decoding.registry import method_of
    from ..sampling_params import SamplingParams

    runner, special = llm.runner, llm.special
    graphs, device = runner.graphs, runner.device
    if graphs is None:
        return 0
    shapes = set()
    for method in methods:
        try:
            params = SamplingParams(method=method, block_length=block_length)
        except ValueError:
            continue
        kind = llm.config.attention.kind
        if kind not in method_of(method, kind).attention_patterns:  # refused on this model
            continue
        steady = method_of(method, kind).steady_pass(params, runner.logit_shift)
        if steady is None:
            continue
        rows, tracked = steady
        for requests in (size for size in batch_sizes if size <= llm.engine.scheduler.max_batch_size):
            longest = min(runner.cache.num_rows // requests, llm.config.max_position)
            for width in key_widths(rows + 1, longest):
                length = min(width, longest)  # a width past the longest sequence: the longest that reaches it
                if bucket(length) != width or (rows, tracked, requests, width) in shapes:  # Flash-Verify's draft
                    continue
                tokens = torch.full((length,), special.mask_id, device=device)
                batch = DecodeBatch.build([RowState(params, 1, tokens, Counters.zeros(device), None, b * length)
                                           for b in range(requests)], special.mask_id, llm.engine.stop_ids,
                                          special.pad_id)
                columns = (length - rows + torch.arange(rows, device=device)).expand(requests, rows)
                # as the methods' steps ask: Flash-Cache tracks its rows, dual-cache keeps its shift columns' K/V
                p = runner.prepare(batch, [rows] * requests, columns,
                                   track=torch.zeros_like(batch.tokens, dtype=torch.bool) if tracked else None,
                                   kept=None if tracked else [runner.logit_shift] * requests)
                for _ in range(2):
                    runner.run(p, torch.zeros(requests, p.metadata.max_kv, device=device) if tracked else None)
                shapes.add((rows, tracked, requests, width))
    graphs.max_graphs += len(shapes)  # kept beside the least recently used ones
    return len(shapes)


@dataclass
class StartUpPhases:
    """What `before_ready` spent its time on (seconds), and how many warm-up requests and pass graphs it ran."""

    cache_s: float = 0.0
    kernels_s: float = 0.0
    requests_s: float = 0.0
    requests: int = 0
    passes_s: float = 0.0
    pass_graphs: int = 0

    def __str__(self) -> str:
        return (f"KV cache {self.cache_s:.1f} s, kernel variants {self.kernels_s:.1f} s, {self.requests} warm-up "
                f"requests {self.requests_s:.1f} s, {self.pass_graphs} steady-pass graphs {self.passes_s:.1f} s")


def before_ready(llm, methods: tuple[str, ...] | None = None, routings: tuple[str | None, ...] = WARM_UP_ROUTINGS,
                 prompt_lengths: tuple[int, ...] = WARM_UP_PROMPT_LENGTHS,
                 max_tokens: tuple[int, ...] = WARM_UP_MAX_TOKENS, block_length: int = 32,
                 row_counts: tuple[int, ...] = ROW_COUNTS, request_counts: tuple[int, ...] = REQUEST_COUNTS,
                 graph_batch_sizes: tuple[int, ...] = STEADY_BATCH_SIZES) -> StartUpPhases:
    """What a server runs before it reports ready (and `bench mix` before its mix): the KV cache, with room for
    the per-layer hidden states where one of `methods` (default: every one) keeps them (Elastic-Cache; allocated
    later, beyond the budget, they could run the device out of memory while serving); on the kernel path,
    compile_kernels' passes, routed too (`row_counts`, `request_counts`), and the warm-up requests of `methods`
    (`warm_up_requests`' arguments). The caller then runs what else it wants warm and stops the CUDA graphs'
    captures (CudaGraphs.stop_capturing). With CUDA graphs, the steady passes' graphs are captured last
    (`capture_steady_passes`, for `graph_batch_sizes` requests). Returns the phases' times."""
    from ..decoding.registry import METHODS, method_of

    runner, phases = llm.runner, StartUpPhases()
    clock = time.perf_counter()

    def lap() -> float:
        nonlocal clock
        before, clock = clock, time.perf_counter()
        return clock - before

    served = tuple(METHODS) if methods is None else methods
    # on CUDA the dense passes' variants compile here
    cache = runner.allocate_cache(with_hidden=any(method_of(m, llm.config.attention.kind).caches_hidden_states
                                                  for m in served))
    phases.cache_s = lap()
    # Under tensor parallelism these would run on rank 0 alone, whose collectives would wait for ranks that never
    # join them: there every rank compiles the dense passes as its cache is allocated, the rest at first launch.
    if runner.kernels and llm.workers is None:
        compile_kernels(llm.model, cache, row_counts, request_counts, ordered=runner.batch_invariant, routed=True)
        phases.kernels_s = lap()
        phases.requests = warm_up_requests(llm, methods, routings, prompt_lengths, max_tokens, block_length)
        phases.requests_s = lap()
        phases.pass_graphs = capture_steady_passes(llm, served, block_length, graph_batch_sizes)
        phases.passes_s = lap()
    return phases


def freeze_heap():
    """Collect the garbage of the start-up, then exempt every object alive now (the model, its kernels and graphs,
    the libraries' modules: hundreds of thousands) from later collections (gc.freeze). A full collection stops the
    engine's thread while it traverses every tracked object, in the middle of a step; after this it traverses only
    what was allocated since. Objects alive now are still freed when their last reference goes; only reference
    cycles among them are no longer collected. Call once, last before ready."""
    gc.collect()
    gc.freeze()


def _fits(engine, prompt_length: int, params) -> bool:
    try:
        engine.check_fits(prompt_length, params)
        return True
    except ValueError:
        return False
