"""The OpenAI request bodies we accept, and how one becomes SamplingParams.

Fields are strict (a string is not an int); a field OpenAI defines that we cannot honour is accepted only at
its neutral value (n=1, top_p=1, no logprobs ...), so a client never gets silently different semantics. The
decoding method and its knobs are extra top-level fields named as in SamplingParams; any other extra field
is an error naming it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from ..decoding.registry import METHODS, method_of
from ..engine.warmup import STEADY_BATCH_SIZES
from ..sampling_params import SamplingParams, knobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}  # newer name


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class CommonRequest(BaseModel):
    """Fields both endpoints take. Extra fields are the decoding method's knobs."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields accepted only at their neutral values (null, as OpenAI allows, means the same).
    n: int | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # flash-dllm's own: the method, its block length, and the output's token ids.
    method: str | None = None
    block_length: int | None = None
    kv_routing: str | None = None   # routed prompt KV (cache/routing.py); null: the server's default
    kv_budget: float | None = None
    return_token_ids: bool | None = False

    def unsupported(self) -> str | None:
        """The first OpenAI field set to a value we cannot honour, as an error message (top_p is a knob of the
        methods that read it: sampling_params)."""
        neutral = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0}
        for name, value in neutral.items():
            if getattr(self, name) not in (None, value):
                return f"{name}={getattr(self, name)} is not supported (only {value})"
        if self.logit_bias:
            return "logit_bias is not supported"
        return self._unsupported()

    def _unsupported(self) -> str | None:
        return None

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(CommonRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs is not supported"
        if self.best_of not in (None, 1):
            return f"best_of={self.best_of} is not supported (only 1)"
        if self.suffix:
            return "suffix is not supported"
        return None

    @property
    def prompts(self) -> list:
        """One entry per choice: a string or a token-id list."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ChatCompletionRequest(CommonRequest):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False

    def _unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs is not supported"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "give max_tokens or max_completion_tokens, not both"
        return None


@dataclass(frozen=True)
class ServerDefaults:
    """The server's defaults for the fields a request leaves out (`flash-dllm serve`'s decoding flags)."""

    params: SamplingParams  # the common fields, and the warm-up's request
    knobs: dict[str, Any] = field(default_factory=dict)  # knobs given on the command line: any method's reads them
    # the methods the server runs (`serve --methods`; None: every one): the start-up warms only these, and the KV
    # cache keeps room for per-layer hidden states only where one of them needs it (Elastic-Cache)
    methods: tuple[str, ...] | None = None
    # the batch sizes whose steady passes the start-up captures as CUDA graphs (`serve --graph-batch-sizes`)
    graph_batch_sizes: tuple[int, ...] = STEADY_BATCH_SIZES

    def __post_init__(self):
        if not self.graph_batch_sizes or min(self.graph_batch_sizes) < 1:
            raise ValueError(f"graph_batch_sizes must be batch sizes >= 1, got {list(self.graph_batch_sizes)}")
        if self.methods is not None and self.params.method not in self.methods:
            raise ValueError(f"the default method {self.params.method!r} is not among the served methods "
                             f"({', '.join(self.methods)}): add it to --methods or pick one of them with --method")


def knobs_read(request: CommonRequest, defaults: ServerDefaults) -> set[str]:
    """The knob names of the request's method (an unknown method: an error naming the methods)."""
    return {f.name for f in dataclasses.fields(method_of(request.method or defaults.params.method).Settings)}


def sampling_params(request: CommonRequest, defaults: ServerDefaults) -> SamplingParams:
    """The request's SamplingParams: its fields over the server's defaults. The server's knob defaults apply
    where the request's method reads them; a knob the request gives must be one its method reads."""
    extras = dict(request.model_extra or {})
    for name in extras:
        if name not in knobs():
            raise ValueError(f"unknown field {name!r}")
    common = defaults.params
    method = request.method or common.method
    if defaults.methods is not None and method in METHODS and method not in defaults.methods:
        raise ValueError(f"method {method!r} is not served here; this server runs {', '.join(defaults.methods)}")
    reads = knobs_read(request, defaults)
    given = {name: value for name, value in defaults.knobs.items() if name in reads} | extras
    # An OpenAI field that some methods read as a knob: at its neutral 1 any method takes it; another value for a
    # method that does not read it is SamplingParams' error, which names the methods that do (as the CLI's).
    if request.top_p is not None and ("top_p" in reads or request.top_p != 1.0):
        given["top_p"] = request.top_p
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    pick = lambda value, default: default if value is None else value
    return SamplingParams(method=method, max_tokens=pick(max_tokens, common.max_tokens),
                          block_length=pick(request.block_length, common.block_length),
                          temperature=pick(request.temperature, common.temperature),
                          seed=pick(request.seed, common.seed), kv_routing=pick(request.kv_routing, common.kv_routing),
                          kv_budget=pick(request.kv_budget, common.kv_budget), **given)
