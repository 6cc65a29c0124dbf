"""Mixed traffic: a seeded mix of prompt lengths, generation lengths, methods and routings arriving as a Poisson
process, against a server (`flash-dllm bench serve --mix`) or offline through the engine (`flash-dllm bench mix`).

Each request's time to its first streamed chunk (TTFT) and to its end, both from its arrival; p50/p90/p99 of
both per method and routing; for requests of equal shape (method, routing, prompt and generation length) the
worst p99/p50 of end-to-end latency; the kernel compiles, CUDA-graph captures and full garbage collections
after ready and their time
(engine/counters.py: from /metrics before and after, or in process); the steps' times per method, batch size,
work and routed rows (`StepShape`; offline: each step; server: the worst step of each minute over its shape's
median, and how many steps that median stood on, from /metrics while the mix runs); the requests running and
waiting (offline: at each step; server: from /metrics every few seconds), which tell a load the engine keeps up
with from one it queues, and the fraction of KV-cache rows held (requests wait with fewer than the maximum running
where no free range of the cache holds the next one); and by minute of arrival, the requests' end-to-end latency
over their shape's p50 (slow requests that cluster in time point at an episode of the engine's, spread ones at the
mix).

Prompts are random token ids (a seeded stream per request); answers are not checked (`bench serve` checks them).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ..engine.counters import ReadyMark, StepShape, percentile, step_ratios, worst_shape
from ..engine.warmup import STEADY_BATCH_SIZES, StartUpPhases, before_ready, freeze_heap

DENSE = "dense"  # the routing label of requests without kv_routing
ARRIVALS = ("poisson", "even")


@dataclass(frozen=True)
class MixSpec:
    """The mix: each request draws a method, then (cached methods only) a routing, a prompt length and a generation
    length uniformly from these; arrivals are a Poisson process of `rate` requests per second, or `even`ly spaced
    at that rate (the same requests): with the number running steady, what is left of the spread of equal
    requests' latency is the engine's, not the arrivals'."""

    num_requests: int = 200
    rate: float = 2.0
    prompt_lengths: tuple[int, ...] = (64, 256, 1024, 4096, 8192)
    max_tokens: tuple[int, ...] = (32, 128, 512)
    methods: tuple[str, ...] = ("prefix-cache", "dual-cache", "flash-cache", "flash-verify", "elastic")
    routings: tuple[str | None, ...] = (None, "chunk")
    block_length: int = 32
    arrivals: str = "poisson"  # or "even"
    max_token_id: int = 1000  # prompt ids in [16, max_token_id): ordinary tokens of any model's vocabulary
    seed: int = 0

    def __post_init__(self):
        if self.num_requests <= 0 or self.rate <= 0:
            raise ValueError("num_requests and rate must be positive")
        if not (self.prompt_lengths and self.max_tokens and self.methods and self.routings):
            raise ValueError("prompt_lengths, max_tokens, methods and routings must each name at least one")
        if min(self.prompt_lengths) <= 0 or min(self.max_tokens) <= 0 or self.max_token_id <= 16:
            raise ValueError("lengths must be positive and max_token_id above 16")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        from ..decoding.registry import method_of
        for method in self.methods:
            method_of(method)  # an unknown method: a ValueError naming the methods


@dataclass(frozen=True)
class MixRequest:
    index: int
    arrival_s: float       # after the mix's start
    prompt_ids: list[int]
    max_tokens: int
    method: str
    kv_routing: str | None

    @property
    def group(self) -> tuple[str, str]:
        return self.method, self.kv_routing or DENSE

    @property
    def shape(self) -> tuple:
        return (*self.group, len(self.prompt_ids), self.max_tokens)

    def fields(self, block_length: int) -> dict:
        """The request's body fields besides the prompt."""
        body = {"method": self.method, "max_tokens": self.max_tokens, "block_length": min(block_length, self.max_tokens),
                "seed": self.index}
        return body | ({"kv_routing": self.kv_routing} if self.kv_routing else {})


def mix_requests(spec: MixSpec, vocab_size: int | None = None) -> list[MixRequest]:
    """The mix's requests in arrival order: a function of the spec alone (and of vocab_size, which caps the ids)."""
    from ..decoding.registry import method_of

    rng = random.Random(spec.seed)
    top = min(spec.max_token_id, vocab_size) if vocab_size else spec.max_token_id
    requests, now = [], 0.0
    for index in range(spec.num_requests):
        gap = rng.expovariate(spec.rate)  # drawn for even arrivals too: the same requests either way
        now += gap if spec.arrivals == "poisson" else 1 / spec.rate
        method = rng.choice(spec.methods)
        routing = rng.choice(spec.routings) if method_of(method).uses_cache else None
        length, tokens = rng.choice(spec.prompt_lengths), rng.choice(spec.max_tokens)
        ids = random.Random(spec.seed * 1_000_003 + index)
        requests.append(MixRequest(index, now, [ids.randrange(16, top) for _ in range(length)], tokens, method,
                                   routing))
    return requests


class LoadSample(NamedTuple):
    running: int
    waiting: int
    kv_cache_use: float  # the fraction of the KV cache's rows held by requests (the fullest replica's)


@dataclass
class MixAnswer:
    request: MixRequest
    ok: bool
    ttft_s: float = 0.0     # arrival to the first streamed chunk
    e2e_s: float = 0.0      # arrival to the end
    tokens: int = 0
    error: str | None = None


@dataclass
class MixResult:
    answers: list[MixAnswer]
    wall_s: float
    compiles: tuple[int, float] = (0, 0.0)   # after ready: (count, seconds)
    captures: tuple[int, float] = (0, 0.0)
    collections: tuple[int, float] = (0, 0.0)
    steps: list[tuple[float, StepShape]] = field(default_factory=list)  # offline: each step's seconds and shape
    # (seconds, the worst step over its shape's median, the steps of that shape in its window)
    longest_step: tuple[float, float, int] = (0.0, 0.0, 0)
    # offline: the compiles, captures and collections after ready per (kind, kernel, graph key or "full")
    after_ready: dict = field(default_factory=dict)
    load: list[LoadSample] = field(default_factory=list)

    @property
    def ok(self) -> list[MixAnswer]:
        return [a for a in self.answers if a.ok]

    def group_rows(self) -> list[tuple]:
        """Per (method, routing): requests, errors, TTFT and end-to-end p50/p90/p99, and the worst p99/p50 of
        end-to-end latency over its shapes with at least two requests."""
        rows = []
        for group in sorted({a.request.group for a in self.answers}):
            answers = [a for a in self.answers if a.request.group == group]
            ok = [a for a in answers if a.ok]
            ttft, e2e = [a.ttft_s for a in ok], [a.e2e_s for a in ok]
            rows.append((*group, len(answers), len(answers) - len(ok),
                         *(f"{percentile(ttft, q):.3f}" for q in (0.5, 0.9, 0.99)),
                         *(f"{percentile(e2e, q):.3f}" for q in (0.5, 0.9, 0.99)),
                         f"{worst_shape_ratio(ok):.2f}"))
        return rows

    def summary_row(self) -> tuple:
        tokens = sum(a.tokens for a in self.ok)
        count, _, worst = worst_shape(self.steps) or (self.longest_step[2], 0.0, self.longest_step[1])
        return (len(self.answers), len(self.answers) - len(self.ok), f"{self.wall_s:.1f}",
                f"{len(self.ok) / self.wall_s:.2f}", f"{tokens / self.wall_s:.1f}", self.compiles[0],
                f"{self.compiles[1]:.2f}", self.captures[0], f"{self.captures[1]:.2f}", self.collections[0],
                f"{self.collections[1]:.2f}", f"{worst:.2f} ({count} steps)", self.load_percentiles("running"),
                self.load_percentiles("waiting"), self.load_percentiles("kv_cache_use", "{:.2f}"))

    def load_percentiles(self, name: str, form: str = "{:.0f}") -> str:
        values = [getattr(sample, name) for sample in self.load]
        return "/".join(form.format(percentile(values, q)) for q in (0.1, 0.5, 0.9)) if values else "-"

    def minute_rows(self) -> list[tuple]:
        """Per minute of arrival: the requests that arrived in it, and their end-to-end latency over the p50 of
        their shape's (shapes with at least two answers): p50, p90, the largest, and how many exceed 1.3x."""
        p50 = {shape: percentile(v, 0.5) for shape, v in e2e_by_shape(self.ok).items() if len(v) >= 2}
        minutes: dict[int, list[float]] = {}
        for a in self.ok:
            if p50.get(a.request.shape, 0) > 0:
                minutes.setdefault(int(a.request.arrival_s // 60), []).append(a.e2e_s / p50[a.request.shape])
        return [(minute, len(v), f"{percentile(v, 0.5):.2f}", f"{percentile(v, 0.9):.2f}", f"{max(v):.2f}",
                 sum(ratio > 1.3 for ratio in v)) for minute, v in sorted(minutes.items())]


GROUP_HEADER = ("method", "routing", "requests", "errors", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "e2e p50 s",
                "e2e p90 s", "e2e p99 s", "worst shape p99/p50")
SUMMARY_HEADER = ("requests", "errors", "wall s", "requests/s", "tokens/s", "compiles after ready", "compile s",
                  "captures after ready", "capture s", "full GCs after ready", "GC s",
                  "longest step / median of its shape", "running p10/p50/p90", "waiting p10/p50/p90",
                  "KV cache use p10/p50/p90")
MINUTE_HEADER = ("minute of arrival", "requests", "e2e / shape p50: p50", "p90", "max", "over 1.3x")
STEP_HEADER = ("method", "batch size", "query rows (to a quarter octave)", "routed rows", "steps", "median step ms",
               "longest / median")


def e2e_by_shape(answers: list[MixAnswer]) -> dict[tuple, list[float]]:
    """The answers' end-to-end latencies, per request shape."""
    by_shape: dict[tuple, list[float]] = {}
    for a in answers:
        by_shape.setdefault(a.request.shape, []).append(a.e2e_s)
    return by_shape


def worst_shape_ratio(answers: list[MixAnswer]) -> float:
    """The largest p99/p50 of end-to-end latency over the shapes with at least two answers (1.0 for none)."""
    ratios = [percentile(v, 0.99) / percentile(v, 0.5) for v in e2e_by_shape(answers).values()
              if len(v) >= 2 and percentile(v, 0.5) > 0]
    return max(ratios, default=1.0)


def format_report(result: MixResult) -> str:
    from ..markdown import markdown_table

    parts = [markdown_table(SUMMARY_HEADER, [result.summary_row()]), "", markdown_table(GROUP_HEADER,
                                                                                           result.group_rows())]
    if len(minutes := result.minute_rows()) > 1:
        parts += ["", markdown_table(MINUTE_HEADER, minutes)]
    if result.steps:
        rows = [(*shape, n, f"{median * 1e3:.1f}", f"{ratio:.2f}")
                for shape, (n, median, ratio) in step_ratios(result.steps).items()]
        parts += ["", markdown_table(STEP_HEADER, rows)]
    if result.after_ready:
        parts += ["", "after ready: " + "; ".join(f"{kind[:-1]} {name} x{t.count} {t.seconds:.3f} s"
                                                  for (kind, name), t in result.after_ready.items())]
    return "\n".join(parts)


def save_answers(result: MixResult, path: str):
    """Every request's shape, arrival and outcome, one JSON object a line (the report's raw material)."""
    with open(path, "w") as out:
        for a in result.answers:
            r = a.request
            out.write(json.dumps({"index": r.index, "method": r.method, "routing": r.kv_routing or DENSE,
                                  "prompt_length": len(r.prompt_ids), "max_tokens": r.max_tokens,
                                  "arrival_s": round(r.arrival_s, 4), "ok": a.ok, "ttft_s": round(a.ttft_s, 4),
                                  "e2e_s": round(a.e2e_s, 4), "tokens": a.tokens, "error": a.error}) + "\n")


def load_answers(path: str) -> list[MixAnswer]:
    """What `save_answers` wrote, as answers to stand-in requests (the prompt's length kept, not its ids)."""
    answers = []
    with open(path) as lines:
        for line in lines:
            r = json.loads(line)
            request = MixRequest(r["index"], r["arrival_s"], [0] * r["prompt_length"], r["max_tokens"], r["method"],
                                 None if r["routing"] == DENSE else r["routing"])
            answers.append(MixAnswer(request, r["ok"], r["ttft_s"], r["e2e_s"], r["tokens"], r["error"]))
    return answers


# Offline: the engine's loop with arrivals (LLM.generate takes its prompts at once; this is its loop, adding each
# request at its arrival time).

def run_offline(llm, spec: MixSpec, requests: list[MixRequest] | None = None) -> MixResult:
    """The mix through llm's engine in this process, in real time. Compiles and captures count from this call's
    start: warm the engine up first (`warm_up`) to see what a served request would wait for."""
    from ..sampling_params import SamplingParams

    engine = llm.engine
    requests = mix_requests(spec, llm.config.vocab_size) if requests is None else requests
    pending, mark, steps, load = deque(requests), ReadyMark(), [], []
    live: dict = {}  # seq -> (request, first chunk time or None)
    answers: dict[int, MixAnswer] = {}
    mark.mark()
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            fields = request.fields(spec.block_length)
            try:
                params = SamplingParams(method=fields["method"], max_tokens=fields["max_tokens"],
                                        block_length=fields["block_length"], seed=fields["seed"],
                                        kv_routing=request.kv_routing)
                live[engine.add_request(request.prompt_ids, params)] = [request, None]
            except ValueError as error:
                answers[request.index] = MixAnswer(request, False, error=str(error))
        if not engine.has_unfinished():
            time.sleep(max(pending[0].arrival_s - (time.perf_counter() - start), 0))
            continue
        began = time.perf_counter()
        finished = engine.step()
        ended = time.perf_counter()
        steps.append((ended - began, engine.last_step))
        allocator = engine.allocator
        load.append(LoadSample(engine.num_running, len(engine.scheduler.waiting),
                               1 - allocator.num_free / allocator.num_rows if allocator is not None else 0.0))
        at = ended - start
        for seq in engine.running:
            if seq in live and live[seq][1] is None and seq.final_length > 0:
                live[seq][1] = at
        for seq in finished:
            if seq not in live:
                continue
            request, first = live.pop(seq)
            first = at if first is None else first
            answers[request.index] = MixAnswer(request, True, first - request.arrival_s, at - request.arrival_s,
                                               len(seq.output_ids))
    wall = time.perf_counter() - start
    after = mark.after()
    tally = lambda kind: (after[kind].count, after[kind].seconds)
    return MixResult([answers[r.index] for r in requests], wall, tally("compiles"), tally("captures"),
                     tally("collections"), steps, after_ready=mark.after_by_name(), load=load)


def warm_up(llm, spec: MixSpec, requests: bool = True, capture_after_ready: bool = False,
            graph_batch_sizes: tuple[int, ...] = STEADY_BATCH_SIZES) -> StartUpPhases | None:
    """What `serve` does before ready (engine/warmup.py's `before_ready` with its defaults: every method and the
    warm-up's own requests, none of the mix's shapes; the mix's block length), then no CUDA-graph captures;
    returns its phases' times; and what the start-up left is frozen out of later garbage collections
    (`freeze_heap`). requests=False: as before issue 40, the KV cache only (and with it, on CUDA,
    compile_kernels' dense passes), nothing frozen: None.
    capture_after_ready: graphs are still captured lazily during the mix (as before issue 40: the throughput
    that stopping the captures costs). graph_batch_sizes: `serve --graph-batch-sizes`."""
    runner = llm.runner
    phases = None
    if requests:
        phases = before_ready(llm, block_length=spec.block_length, graph_batch_sizes=graph_batch_sizes)
    else:
        runner.allocate_cache(with_hidden=True)
    if runner.graphs is not None and not capture_after_ready:
        runner.graphs.stop_capturing()
    if requests:
        freeze_heap()
    return phases


# Against a server.

@dataclass(frozen=True)
class MixServeConfig:
    url: str = "http://127.0.0.1:8000"
    spec: MixSpec = MixSpec()
    fields: dict = field(default_factory=dict)  # extra request fields for every request (knobs, temperature)
    api_key: str | None = None
    # /metrics (the longest step of the last minute, the requests running) this often on average, each wait drawn
    # from 0.5-1.5x of it: fixed waits alias with even arrivals (every 5 s is every 7th arrival at 1.4/s, so each
    # sample caught a request that had just arrived, waiting)
    metrics_every_s: float = 5.0


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> each metric's value summed over its labels (replicas)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            sums[name] = sums.get(name, 0.0) + float(value)
    return sums


def metric_values(text: str, name: str) -> dict[str, float]:
    """A /metrics family's values by their labels ("" for none; with replicas '{replica="i"}')."""
    return {line[len(name):].rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))}


def metric_max(text: str, name: str) -> float:
    return max(metric_values(text, name).values(), default=0.0)


def longest_step(text: str) -> tuple[float, float, int]:
    """/metrics' longest step of the last minute, and its replica's largest step ratio with the steps behind it."""
    ratios = metric_values(text, "flash_dllm_step_seconds_max_ratio")
    steps = metric_values(text, "flash_dllm_step_seconds_max_ratio_steps")
    worst = max(ratios, key=ratios.get, default=None)
    return (metric_max(text, "flash_dllm_step_seconds_max"), ratios.get(worst, 0.0), int(steps.get(worst, 0)))


async def send(client, config: MixServeConfig, request: MixRequest, start: float) -> MixAnswer:
    body = {"prompt": request.prompt_ids, "stream": True, "return_token_ids": True,
            **request.fields(config.spec.block_length), **config.fields}
    arrival = start + request.arrival_s
    first, tokens = None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return MixAnswer(request, False, error=f"{response.status_code} {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return MixAnswer(request, False, error=chunk["error"]["message"])
                first = time.perf_counter() if first is None else first
                tokens += sum(len(c.get("token_ids") or []) for c in chunk["choices"])
    except Exception as error:  # httpx's errors, a broken stream
        return MixAnswer(request, False, error=f"{type(error).__name__}: {error}")
    end = time.perf_counter()
    return MixAnswer(request, True, (first or end) - arrival, end - arrival, tokens)


async def run_online(config: MixServeConfig) -> MixResult:
    from .serve import server_client

    spec = config.spec
    async with server_client(config.url, config.api_key, spec.num_requests + 2, 3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]
        requests = mix_requests(spec, model.get("vocab_size"))  # prompt ids within the served vocabulary
        before = metric_sums((await client.get("/metrics")).text)
        longest: list[tuple[float, float, int]] = []
        load: list[LoadSample] = []

        async def sample_steps():
            jitter = random.Random(spec.seed)
            while True:
                await asyncio.sleep(config.metrics_every_s * jitter.uniform(0.5, 1.5))
                text = (await client.get("/metrics")).text
                longest.append(longest_step(text))
                sums = metric_sums(text)
                load.append(LoadSample(int(sums.get("flash_dllm_requests_running", 0)),
                                       int(sums.get("flash_dllm_requests_waiting", 0)),
                                       metric_max(text, "flash_dllm_kv_cache_usage_ratio")))

        sampler = asyncio.create_task(sample_steps())
        start = time.perf_counter()
        tasks = []
        for request in requests:
            await asyncio.sleep(max(start + request.arrival_s - time.perf_counter(), 0))
            tasks.append(asyncio.create_task(send(client, config, request, start)))
        answers = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        sampler.cancel()
        text = (await client.get("/metrics")).text
        after = metric_sums(text)
        longest.append(longest_step(text))
    delta = lambda name: after.get(f"flash_dllm_{name}", 0.0) - before.get(f"flash_dllm_{name}", 0.0)
    return MixResult(list(answers), wall,
                     (int(delta("kernel_compiles_after_ready_total")), delta("kernel_compile_seconds_after_ready_total")),
                     (int(delta("graph_captures_after_ready_total")), delta("graph_capture_seconds_after_ready_total")),
                     (int(delta("gc_collections_after_ready_total")), delta("gc_collection_seconds_after_ready_total")),
                     longest_step=max(longest, key=lambda s: s[1]), load=load)


def bench_serve_mix(config: MixServeConfig) -> MixResult:
    return asyncio.run(run_online(config))
