"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every request is checked before it reaches the engine: a body over --max-request-bytes is a 413 (never read
whole), a Content-Type other than application/json a 415; malformed JSON, wrong types, out-of-range values,
unknown methods or fields and prompts that can never fit are a 400 naming the culprit; beyond the queue's
bound a 429 with Retry-After. Prompts are tokenised on a worker thread: a long one never stalls the event loop
(/health, the other requests' streams). Accepted requests share one engine loop (serve/async_engine.py), or
with data parallelism go to the least busy of several replicas, each a process with its own engine loop
(serve/replicas.py).

The server listens while it starts: until the KV cache is allocated and the kernels are compiled (`start_up`,
on the engine's thread), /health answers 503 {"status": "starting"} and completions a 503 with Retry-After.

Streaming sends the output's final prefix as it grows: a dLLM decodes positions out of order, so text is
sent once every position before it is decoded, in order, and the chunks concatenate to the non-streamed
text. Stop strings end a request as soon as the final prefix contains one.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..llm import LLM
from .async_engine import Accepted, AsyncEngine, Failed, Finished, Prefix, Rejected, Request, Stats
from .protocol import ChatCompletionRequest, CommonRequest, CompletionRequest, ServerDefaults, sampling_params

if TYPE_CHECKING:
    from .replicas import ReplicaPool

log = logging.getLogger("flash_dllm.serve")
DISCONNECT_POLL_S = 0.5  # how often a waiting request asks whether its client is still there
STARTING_RETRY_AFTER_S = 5  # a cold start compiles for 10-20 s (H200)
# A prompt of the longest context we serve (Dream: 131,072 tokens) at 32 bytes a token, the most a real prompt
# takes in JSON: a token of non-Latin text is 1-3 characters, each a 6-byte \uXXXX escape (12 beyond the BMP) from
# json.dumps' default; English takes ~5 bytes a token, a token-id list at most 8 ("126336, ").
MAX_REQUEST_BYTES = 131_072 * 32  # 4 MiB
# A token covers at most its vocabulary entry's characters (a byte-level entry has a character per byte, a
# sentencepiece one a U+2581 per space), after a normalizer that may merge up to 4 characters into one (NFC: U+1FAF
# is an omega and 3 marks).
NORMALIZER_MERGE = 4


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    defaults: ServerDefaults
    max_queue: int = 256           # requests waiting beyond the running batch before 429
    api_key: str | None = None     # required as "Authorization: Bearer KEY" on /v1/* when set
    step_trace: str | None = None  # a file for every engine step (engine/counters.StepTrace)
    max_request_bytes: int = MAX_REQUEST_BYTES  # a larger request body is a 413

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def error_response(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def validation_message(error: RequestValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
    return f"{where or 'body'}: {first['msg']}"


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413 and is never held whole. A Content-Length over
    the limit is refused before the app runs; a chunked body as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def message(self, size: str) -> str:
        return f"the request body{size} is over the server's limit of {self.limit} bytes (--max-request-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")  # the server has checked that it is a number
        if declared is not None and int(declared) > self.limit:
            return await error_response(413, self.message(f" of {int(declared)} bytes"))(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # FastAPI re-raises an HTTPException from reading the body: our 413 handler
                raise StarletteHTTPException(413, self.message(""))
            return message

        await self.app(scope, counted_receive, send)


def max_prompt_chars(tokenizer, context: int) -> int | None:
    """More characters than this can never fit `context` tokens (None without a tokenizer): a check that needs no
    tokenising."""
    if tokenizer is None:
        return None
    return context * max(map(len, tokenizer.get_vocab())) * NORMALIZER_MERGE


class TextStream:
    """One choice's text as its final prefix grows: what has been sent, and where a stop string cuts it."""

    def __init__(self, llm: LLM, stops: list[str]):
        self.llm, self.stops, self.sent = llm, stops, ""
        self.holdback = max((len(s) for s in stops), default=1) - 1  # a stop string may still be completing

    def cut(self, text: str) -> tuple[str, bool]:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return (text[:min(found)], True) if found else (text, False)

    def grow(self, ids: list[int]) -> tuple[str, bool]:
        """The new text of a longer final prefix, and whether a stop string ended it."""
        text, stopped = self.cut(self.llm.decode(ids))
        if not stopped:
            # Hold back what later tokens can still change: the last token and trailing spaces (a tokenizer's
            # clean-up merges " ," into ","), a half-decoded character, and a possible stop string's start.
            text = self.llm.decode(ids[:-1]).rstrip("\ufffd").rstrip()
            text = text[:max(len(text) - self.holdback, 0)]
        if not text.startswith(self.sent):
            return "", stopped
        delta, self.sent = text[len(self.sent):], text
        return delta, stopped

    def tokens_within(self, ids: list[int]) -> list[int]:
        """The shortest prefix of ids whose text covers the text sent (a stop string cut the rest)."""
        for length in range(len(ids) + 1):
            if len(self.llm.decode(ids[:length])) >= len(self.sent):
                return ids[:length]
        return ids

    def finish(self, ids: list[int]) -> tuple[str, bool]:
        text, stopped = self.cut(self.llm.decode(ids))
        if not text.startswith(self.sent):
            log.warning("streamed text is not a prefix of the final text")
        delta, self.sent = text[len(self.sent):], text
        return delta, stopped


class Choice:
    """One prompt of a request: its engine request, text stream and outcome."""

    def __init__(self, index: int, request: Request, stream: TextStream):
        self.index, self.request, self.text = index, request, stream
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.nfe = self.steps = 0

    def on_event(self, event) -> str | None:
        """Apply an engine event; the new text, if any."""
        if isinstance(event, Prefix):
            delta, stopped = self.text.grow(event.token_ids)
            self.token_ids, self.nfe, self.steps = event.token_ids, event.nfe, event.steps
            if stopped:
                self.finish_reason = "stop"
                self.token_ids = self.text.tokens_within(event.token_ids)
            return delta
        if isinstance(event, Finished):
            seq = event.seq
            delta, stopped = self.text.finish(seq.output_ids)
            self.token_ids, self.nfe, self.steps = seq.output_ids, seq.nfe, seq.steps
            if stopped:
                self.token_ids = self.text.tokens_within(seq.output_ids)
            self.finish_reason = "stop" if stopped else seq.finish_reason
            return delta
        if isinstance(event, Failed):
            raise APIError(event.status, event.message, "server_error")
        return None


def build_app(llm: LLM, config: ServeConfig, start_up: Callable[[], None] | None = None,
              engine: AsyncEngine | ReplicaPool | None = None) -> FastAPI:
    """llm: the model the front tokenises for (an LLM, or replicas.ModelFront, without weights).
    start_up: run on the engine's thread before it takes requests (`start_up` below, for `serve`).
    engine: the engine client; default: an AsyncEngine over `llm` in this process."""
    if engine is None:
        engine = AsyncEngine(llm, start_up, config.step_trace)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="flash-dllm", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=config.max_request_bytes)
    app.state.engine = engine
    capacity = engine.max_batch_size + config.max_queue
    in_flight = {"requests": 0, "throttled": 0}

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_, error: RequestValidationError):
        return error_response(400, validation_message(error))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, error: StarletteHTTPException):  # unknown paths, bodies that cannot be parsed
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(APIError)
    async def on_api_error(_, error: APIError):
        return error_response(error.status, error.message, error.kind, error.headers)

    def check_api_key(http: HTTPRequest):
        if config.api_key and http.headers.get("authorization") != f"Bearer {config.api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")

    def check_model(body: CommonRequest):
        if body.model is not None and body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {config.model_name!r}",
                           "not_found_error")

    def check_json(http: HTTPRequest):
        media_type = http.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":  # as vLLM: 415, not a validation error about the unparsed bytes
            sent = f"got {media_type!r}" if media_type else "the request has none"
            raise APIError(415, f"Content-Type must be application/json; {sent}")

    most_chars = max_prompt_chars(llm.tokenizer, llm.config.max_position)

    def check_length(chars: int):
        if most_chars is not None and chars > most_chars:
            raise ValueError(f"the prompt is {chars} characters: more than the model's context of "
                             f"{llm.config.max_position} tokens can hold (at most {most_chars} characters)")

    def encode_completions(prompts: list) -> list[list[int]]:
        """Each prompt's token ids, a 400 naming the first that fails (on a worker thread: tokenising is slow)."""
        encoded = []
        for index, prompt in enumerate(prompts):
            try:
                if not prompt:
                    raise ValueError("the prompt is empty")
                if isinstance(prompt, str):
                    check_length(len(prompt))
                encoded.append(llm.encode(prompt, chat_template=False))  # completions take raw text
            except ValueError as error:
                raise APIError(400, (f"prompt {index}: " if len(prompts) > 1 else "") + str(error)) from None
        return encoded

    def encode_chat(messages: list[dict]) -> list[int]:
        try:
            check_length(sum(len(message["content"]) for message in messages))
            return llm.encode(messages)
        except ValueError as error:
            raise APIError(400, str(error)) from None

    def admit(body: CommonRequest, prompts: list[list[int]]) -> list[Request]:
        """Checked requests for the engine (400 on a bad one), within the queue's bound (429 beyond it)."""
        check_model(body)
        try:
            if message := body.unsupported():
                raise ValueError(message)
            params = sampling_params(body, config.defaults)
        except ValueError as error:
            raise APIError(400, str(error)) from None
        if body.stops and llm.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none")
        for index, ids in enumerate(prompts):
            if len(ids) + params.max_tokens > llm.config.max_position:
                where = f"prompt {index}: " if len(prompts) > 1 else ""
                raise APIError(400, f"{where}{len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                                    f"model's context of {llm.config.max_position} tokens")
        if len(prompts) > capacity:
            raise APIError(400, f"{len(prompts)} prompts exceed the server's capacity of {capacity} requests")
        if in_flight["requests"] + len(prompts) > capacity:
            in_flight["throttled"] += 1
            raise APIError(429, f"the server is at capacity ({capacity} requests running or queued); retry later",
                           "rate_limit_error", headers={"Retry-After": "1"})
        return [Request(ids, params, stream=body.stream or bool(body.stops)) for ids in prompts]

    async def start(requests: list[Request]):
        """Hand the requests to the engine; a rejected one (it can never fit) fails the call with a 400."""
        if not engine.ready.is_set():
            raise APIError(503, "the server is starting (allocating the KV cache, compiling kernels); retry later",
                           "server_error", headers={"Retry-After": str(STARTING_RETRY_AFTER_S)})
        in_flight["requests"] += len(requests)
        try:
            outcomes = await engine.submit(requests)
        except BaseException:
            release(requests)
            raise
        refused = [(i, o) for i, o in enumerate(outcomes) if not isinstance(o, Accepted)]
        if refused:
            release(requests)
            index, outcome = refused[0]
            where = f"prompt {index}: " if len(requests) > 1 else ""
            if isinstance(outcome, Rejected):
                raise APIError(400, where + outcome.message)
            raise APIError(outcome.status, where + outcome.message, "server_error")

    def release(requests: list[Request]):
        """Abort what is still running (a no-op for finished requests) and free the requests' slots."""
        for request in requests:
            engine.abort(request)
        in_flight["requests"] -= len(requests)

    async def events(choices: list[Choice], http: HTTPRequest):
        """(choice, new text) as engine events arrive, until every choice has finished; stops when the client
        disconnects."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice):
            while True:
                event = await choice.request.events.get()
                await merged.put((choice, event))
                if isinstance(event, (Finished, Failed)):
                    return

        pumps = [asyncio.create_task(pump(choice)) for choice in choices]
        checked = time.monotonic()
        try:
            while any(choice.finish_reason is None for choice in choices):
                if time.monotonic() - checked > DISCONNECT_POLL_S:  # also while events keep coming
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return
                try:
                    choice, event = await asyncio.wait_for(merged.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                if choice.finish_reason is not None:
                    continue  # a stop string ended it already
                delta = choice.on_event(event)
                if choice.finish_reason is not None:
                    engine.abort(choice.request)
                yield choice, delta
        finally:
            for task in pumps:
                task.cancel()

    def usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
        prompt_tokens = sum(len(ids) for ids in prompts)
        completion_tokens = sum(len(choice.token_ids) for choice in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "nfe": sum(c.nfe for c in choices), "steps": sum(c.steps for c in choices)}

    async def respond(http: HTTPRequest, body: CommonRequest, prompts: list[list[int]], chat: bool,
                      echo: list[str] | None = None):
        requests = admit(body, prompts)
        await start(requests)
        choices = [Choice(i, request, TextStream(llm, body.stops)) for i, request in enumerate(requests)]
        header = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                  "model": config.model_name}
        with_ids = body.return_token_ids or llm.tokenizer is None
        if body.stream:
            return StreamingResponse(stream(http, body, choices, prompts, header, chat, with_ids, echo, requests),
                                     media_type="text/event-stream")
        try:
            async for _ in events(choices, http):
                pass
        finally:
            release(requests)
        out = []
        for choice in choices:
            text = (echo[choice.index] if echo else "") + choice.text.sent
            item = ({"index": choice.index, "message": {"role": "assistant", "content": text},
                     "finish_reason": choice.finish_reason} if chat else
                    {"index": choice.index, "text": text, "logprobs": None, "finish_reason": choice.finish_reason})
            if with_ids:
                item["token_ids"] = choice.token_ids
            out.append(item)
        return {**header, "object": "chat.completion" if chat else "text_completion", "choices": out,
                "usage": usage(choices, prompts)}

    async def stream(http, body, choices, prompts, header, chat, with_ids, echo, requests):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: Choice, text: str | None, ids: list[int] | None = None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                item = {"index": choice.index, "delta": delta, "finish_reason": choice.finish_reason}
            else:
                item = {"index": choice.index, "text": text or "", "logprobs": None,
                        "finish_reason": choice.finish_reason}
            if ids is not None:
                item["token_ids"] = ids
            return "data: " + json.dumps({**header, "object": kind, "choices": [item]}) + "\n\n"

        sent_ids = {choice.index: 0 for choice in choices}
        try:
            for choice in choices:
                if chat or echo:
                    yield chunk(choice, echo[choice.index] if echo else "", [] if with_ids else None, role=chat)
            async for choice, delta in events(choices, http):
                ids = None
                if with_ids:
                    ids = choice.token_ids[sent_ids[choice.index]:]
                    sent_ids[choice.index] = len(choice.token_ids)
                if delta or choice.finish_reason is not None or ids:
                    yield chunk(choice, delta, ids)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield "data: " + json.dumps({**header, "object": kind, "choices": [],
                                             "usage": usage(choices, prompts)}) + "\n\n"
            yield "data: [DONE]\n\n"
        except APIError as error:
            yield "data: " + json.dumps({"error": {"message": error.message, "type": error.kind,
                                                   "code": error.status}}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            release(requests)

    api = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @api.post("/completions", dependencies=[Depends(check_json)])
    async def completions(body: CompletionRequest, http: HTTPRequest):
        prompts = await asyncio.to_thread(encode_completions, body.prompts)
        echo = None
        if body.echo:  # decoding a long token-id prompt is slow too
            echo = await asyncio.to_thread(lambda: [p if isinstance(p, str) else llm.decode(p) for p in body.prompts])
        return await respond(http, body, prompts, chat=False, echo=echo)

    @api.post("/chat/completions", dependencies=[Depends(check_json)])
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        if not body.messages:
            raise APIError(400, "messages is empty")
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
        prompt = await asyncio.to_thread(encode_chat, [message.as_dict() for message in body.messages])
        return await respond(http, body, [prompt], chat=True)

    @api.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "flash-dllm", "max_model_len": llm.config.max_position,
                                            "vocab_size": llm.config.vocab_size}]}

    app.include_router(api)

    @app.get("/health")
    async def health():
        body = engine.health()
        if body is None:
            return error_response(503, "the engine loop has stopped", "server_error")
        return JSONResponse(body, 200 if body["status"] in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def metrics():
        text = prometheus_text(await engine.replica_stats(), in_flight["throttled"])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def prometheus_text(replicas: list[tuple[str | None, Stats, bool]], throttled: int) -> str:
    """replicas: (label, counters, is serving) of each replica. One replica without a label has unlabelled
    metrics; replicas have replica="i" on each, and replica_up."""
    lines = []

    def labels(replica: str | None, **more: str) -> str:
        pairs = {**more, **({} if replica is None else {"replica": replica})}
        return "{" + ",".join(f'{key}="{value}"' for key, value in pairs.items()) + "}" if pairs else ""

    def metric(name: str, kind: str, help: str, rows: list[tuple[str, float]]):
        lines.extend([f"# HELP flash_dllm_{name} {help}", f"# TYPE flash_dllm_{name} {kind}"])
        lines.extend(f"flash_dllm_{name}{where} {value}" for where, value in rows)

    def each(value_of: Callable[[Stats], float]) -> list[tuple[str, float]]:
        return [(labels(replica), value_of(stats)) for replica, stats, _ in replicas]

    def per_request(stats: Stats) -> float:
        finished = sum(stats.finished.values()) - stats.finished["abort"] - stats.finished["error"]
        return stats.nfe / max(finished, 1)

    metric("requests_total", "counter", "Requests that ended, by how.",
           [(labels(replica, outcome=k), v) for replica, stats, _ in replicas for k, v in stats.finished.items()])
    metric("requests_rejected_total", "counter", "Requests refused: the KV cache can never hold them.",
           each(lambda s: s.rejected))
    metric("requests_throttled_total", "counter", "Requests refused with 429: queue full.", [("", throttled)])
    metric("requests_running", "gauge", "Requests in the running batch.", each(lambda s: s.running))
    metric("requests_waiting", "gauge", "Requests queued for the running batch.", each(lambda s: s.waiting))
    metric("generated_tokens_total", "counter", "Generated tokens (up to the first eos/eot).",
           each(lambda s: s.generated_tokens))
    metric("denoising_steps_total", "counter", "Denoising steps of finished requests.", each(lambda s: s.steps))
    metric("nfe_total", "counter", "Forward passes (NFE) of finished requests.", each(lambda s: s.nfe))
    metric("engine_iterations_total", "counter", "Engine steps over the running batch.", each(lambda s: s.iterations))
    metric("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
           each(lambda s: s.tokens_per_s()))
    metric("tokens_per_step", "gauge", "Generated tokens per denoising step, finished requests.",
           each(lambda s: s.generated_tokens / max(s.steps, 1)))
    metric("nfe_per_request", "gauge", "Forward passes per finished request.", each(per_request))
    metric("kv_cache_rows", "gauge", "KV-cache capacity in token rows (0 before the first cached request).",
           each(lambda s: s.kv_cache_rows))
    metric("kv_cache_usage_ratio", "gauge", "Fraction of KV-cache rows held by requests.",
           each(lambda s: s.kv_cache_used / max(s.kv_cache_rows, 1)))
    metric("kv_cache_compactions_total", "counter", "Compactions of the KV cache: its held ranges slid to its start "
           "so that a waiting request's rows, free but not in one range, became one.",
           each(lambda s: s.kv_cache_compactions))
    metric("kv_cache_rows_moved_total", "counter", "Cache rows those compactions copied.",
           each(lambda s: s.kv_cache_rows_moved))
    metric("start_up_seconds", "gauge", "Seconds from the engine loop's start to ready (KV cache, compiles, warm-up).",
           each(lambda s: s.start_up_s))
    metric("kernel_compiles_after_ready_total", "counter", "Triton kernel variants compiled (or loaded) on a "
           "request's path, after ready.", each(lambda s: s.compiles_after_ready))
    metric("kernel_compile_seconds_after_ready_total", "counter", "Seconds of those compiles.",
           each(lambda s: s.compile_s_after_ready))
    metric("graph_captures_after_ready_total", "counter", "CUDA graphs captured on a request's path, after ready.",
           each(lambda s: s.captures_after_ready))
    metric("graph_capture_seconds_after_ready_total", "counter", "Seconds of those captures.",
           each(lambda s: s.capture_s_after_ready))
    metric("gc_collections_after_ready_total", "counter", "Full collections of Python's garbage collector after "
           "ready (each stops the engine's thread).", each(lambda s: s.collections_after_ready))
    metric("gc_collection_seconds_after_ready_total", "counter", "Seconds of those collections.",
           each(lambda s: s.collection_s_after_ready))
    metric("step_seconds_max", "gauge", "The longest engine step of the last minute.", each(lambda s: s.longest_step_s))
    metric("step_seconds_max_ratio", "gauge", "The largest ratio of a step of the last minute to the median step of "
           "its method, batch size, query rows (to a quarter octave) and routed rows in that minute.",
           each(lambda s: s.longest_step_ratio))
    metric("step_seconds_max_ratio_steps", "gauge", "How many steps of that ratio's shape the last minute had (a median "
           "of a few is noisy).", each(lambda s: s.longest_step_ratio_steps))
    if any(replica is not None for replica, _, _ in replicas):
        metric("replica_up", "gauge", "1 while the replica serves, 0 while it starts or once it has stopped.",
               [(labels(replica), int(up)) for replica, _, up in replicas])
    return "\n".join(lines) + "\n"


def start_up(llm: LLM, defaults: ServerDefaults):
    """What runs before the server reports ready (engine/warmup.py's `before_ready`): the KV cache, the kernels'
    compiles and the warm-up requests; then one request with the server's defaults (its first-call allocations),
    not in the first client's latency. From then on no CUDA graph is captured: none on a request's path; and a
    full garbage collection does not traverse what the start-up left (`freeze_heap`)."""
    from ..engine.warmup import before_ready, freeze_heap

    phases = before_ready(llm, methods=defaults.methods, block_length=defaults.params.block_length,
                          graph_batch_sizes=defaults.graph_batch_sizes)
    print(f"flash-dllm: start-up: {phases}", file=sys.stderr, flush=True)
    probe = llm.encode("Hello") if llm.tokenizer is not None else [1, 2, 3, 4]
    llm.generate([probe], defaults.params, use_tqdm=False)
    if llm.runner.graphs is not None:
        llm.runner.graphs.stop_capturing()
    freeze_heap()


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a taken port is a one-line error, not a wait."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def serve(llm: LLM, config: ServeConfig, sock: socket.socket, pool: ReplicaPool | None = None):
    """Serve on `sock` until interrupted; it listens from the start (/health: "starting", then "ok"). A failed
    start-up stops the server and is raised here. pool: data-parallel replicas (then `llm` is their
    replicas.ModelFront), started and stopped with the server."""
    import uvicorn

    failed: list[BaseException] = []

    def start():
        try:
            start_up(llm, config.defaults)
        except BaseException as error:
            failed.append(error)
            server.should_exit = True
            raise
        ready()

    started = time.perf_counter()

    def ready():
        print(f"flash-dllm: ready ({time.perf_counter() - started:.1f} s after listening)", file=sys.stderr, flush=True)

    def replica_failed(error: BaseException):
        failed.append(error)
        server.should_exit = True

    if pool is None:
        app = build_app(llm, config, start)
    else:
        pool.on_ready, pool.on_failure = ready, replica_failed
        app = build_app(llm, config, engine=pool)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn has shut down gracefully and re-raises the signal: a normal stop
        pass
    if failed:
        raise failed[0]
