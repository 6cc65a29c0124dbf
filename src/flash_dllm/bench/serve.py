"""`flash-dllm bench serve`: concurrent clients against a running server, then a check of every answer.

Each of N clients sends requests back to back for T seconds (after one untimed round), each request prompt
k of a fixed pool with seed k. Throughput counts completion tokens (up to the first eos/eot) over the wall
time of the timed phase. Then every prompt that was sent is asked again alone, and each answer of the load
phase must equal that single request's token ids: batching with other requests changes nothing.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    clients: int = 64
    duration_s: float = 60.0
    prompts: str = "tasks"           # "tasks": the embedded tasks' held-out items (chat); "random": token ids
    num_prompts: int = 64
    prompt_length: int = 256         # random prompts' length in tokens
    fields: dict = field(default_factory=dict)  # extra request fields: max_tokens, method, knobs, temperature
    api_key: str | None = None

    def __post_init__(self):
        if self.clients <= 0 or self.duration_s <= 0 or self.num_prompts <= 0:
            raise ValueError("clients, duration and num_prompts must be positive")
        if self.prompts not in ("tasks", "random"):
            raise ValueError(f"prompts must be 'tasks' or 'random', got {self.prompts!r}")


@dataclass
class Answer:
    prompt: int
    status: int
    latency_s: float
    token_ids: list[int] | None = None
    nfe: int = 0
    steps: int = 0
    error: str | None = None


@dataclass
class ServeBenchResult:
    clients: int
    wall_s: float
    answers: list[Answer]
    equal: int        # load-phase answers equal to the prompt's single-request answer
    compared: int

    @property
    def ok(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 200]

    @property
    def errors(self) -> int:
        return len(self.answers) - len(self.ok)

    def row(self) -> tuple:
        ok = self.ok
        latencies = sorted(a.latency_s for a in ok) or [0.0]
        tokens = sum(len(a.token_ids) for a in ok)
        quantile = lambda q: latencies[max(math.ceil(q * len(latencies)) - 1, 0)]  # nearest rank
        return (self.clients, f"{self.wall_s:.1f}", len(ok), self.errors, f"{len(ok) / self.wall_s:.2f}",
                f"{tokens / self.wall_s:.1f}", f"{statistics.median(latencies):.3f}", f"{quantile(0.99):.3f}",
                f"{sum(a.nfe for a in ok) / max(len(ok), 1):.1f}",
                f"{tokens / max(sum(a.steps for a in ok), 1):.2f}", f"{self.equal}/{self.compared}")


HEADER = ("clients", "wall s", "requests", "errors", "requests/s", "tokens/s", "p50 latency s", "p99 latency s",
          "NFE/request", "tokens/step", "equal to single")


def prompt_pool(config: ServeBenchConfig) -> list[dict]:
    """Request bodies (without sampling fields), one per prompt index."""
    if config.prompts == "random":
        rng = random.Random(0)
        return [{"prompt": [rng.randrange(1000) for _ in range(config.prompt_length)]}
                for _ in range(config.num_prompts)]
    from ..tasks import load_test_set

    items = [item for task in ("arith", "trace") for item in load_test_set(task)]
    return [{"messages": [{"role": "user", "content": item.prompt}]} for item in items[:config.num_prompts]]


async def ask(client: httpx.AsyncClient, config: ServeBenchConfig, pool: list[dict], k: int) -> Answer:
    body = {**pool[k], "seed": k, "return_token_ids": True, **config.fields}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.perf_counter()
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as error:
        return Answer(k, 0, time.perf_counter() - start, error=f"{type(error).__name__}: {error}")
    latency = time.perf_counter() - start
    if response.status_code != 200:
        if response.status_code == 429:  # counted as an error, and the client backs off as told
            await asyncio.sleep(float(response.headers.get("retry-after", 1)))
        return Answer(k, response.status_code, latency, error=response.text[:200])
    out = response.json()
    return Answer(k, 200, latency, out["choices"][0]["token_ids"], out["usage"]["nfe"], out["usage"]["steps"])


@contextlib.asynccontextmanager
async def server_client(url: str, api_key: str | None, connections: int, timeout: float):
    """An HTTP client of the server at `url`, once its /health answers 200 (else a ValueError naming it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers=headers) as client:
        try:
            health = await client.get("/health")
        except httpx.ConnectError:
            raise ValueError(f"no server answers at {url} (start one with `flash-dllm serve`)") from None
        if health.status_code != 200:
            raise ValueError(f"{url}/health answered {health.status_code}")
        yield client


async def run(config: ServeBenchConfig) -> ServeBenchResult:
    pool = prompt_pool(config)
    async with server_client(config.url, config.api_key, config.clients + 1, 600) as client:
        counter = iter(range(1 << 62))
        await asyncio.gather(*(ask(client, config, pool, next(counter) % len(pool)) for _ in range(config.clients)))

        answers: list[Answer] = []
        start = time.perf_counter()
        deadline = start + config.duration_s

        async def client_loop():
            while time.perf_counter() < deadline:
                answers.append(await ask(client, config, pool, next(counter) % len(pool)))

        await asyncio.gather(*(client_loop() for _ in range(config.clients)))
        wall = time.perf_counter() - start

        single = {}
        for k in sorted({a.prompt for a in answers if a.status == 200}):
            alone = await ask(client, config, pool, k)
            single[k] = alone.token_ids if alone.status == 200 else None
    compared = [a for a in answers if a.status == 200]
    equal = sum(a.token_ids == single[a.prompt] for a in compared)
    return ServeBenchResult(config.clients, wall, answers, equal, len(compared))


def bench_serve(config: ServeBenchConfig) -> ServeBenchResult:
    return asyncio.run(run(config))
