"""Per-request decoding settings: the fields every method reads, and the method's own settings."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .cache.routing import POLICIES
from .decoding.base import check, check_type
from .decoding.registry import DEFAULT_METHOD, METHODS, method_of, variants

DEFAULT_KV_BUDGET = 0.125  # the fraction of a routed prompt's keys a step reads, when kv_routing is given alone


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How one request is decoded.

    method: a registered decoding method (decoding/registry.py; README.md describes each).
    max_tokens: generation length G (the number of mask positions appended to the prompt).
    block_length: semi-autoregressive block size; blocks are decoded left to right, the last one shorter where
        max_tokens is not a multiple of it (a method without blocks, elastic or dream, ignores it).
    temperature: 0 is greedy; > 0 samples with Gumbel-max noise in float64, reproducible per `seed`.
    kv_routing: None (dense) or how a cached method reads the prompt's KV: "chunk", "centroid", "kmeans",
        "window" or "random" (cache/routing.py); only the prompt's regions that the step's queries may need are
        read.
    kv_budget: with kv_routing, the fraction of the prompt's keys each step reads, in (0, 1] (sinks and the
        recent window included; 1 reads every chunk); default DEFAULT_KV_BUDGET with a routing, None without
        (a budget without a routing is an error). Under 1, Flash-Cache and Flash-Verify stop recomputing
        prompt positions after the first pass (decoding/flash_cache.py).
    settings: the method's settings dataclass (its knobs and their defaults: `method_of(method).Settings`).
        Knobs may also be given as keywords, `SamplingParams(method="flash-cache", tracking_budget=40)`; a
        knob that the method does not read is an error.
    """

    method: str
    max_tokens: int
    block_length: int
    temperature: float
    seed: int
    kv_routing: str | None
    kv_budget: float | None
    settings: Any

    def __init__(self, method: str = DEFAULT_METHOD, max_tokens: int = 128, block_length: int = 32,
                 temperature: float = 0.0, seed: int = 0, kv_routing: str | None = None, kv_budget: float | None = None,
                 settings: Any = None, **given):
        decoding = method_of(method)
        if given:
            check(settings is None, "give the method's knobs either as `settings` or as keywords, not both")
            settings = _settings_from_keywords(method, given)
        elif settings is None:
            settings = decoding.Settings()
        check(type(settings) is decoding.Settings,
               f"settings of method {method!r} are {decoding.Settings.__name__}, got {type(settings).__name__}")
        for name, value in (("method", method), ("max_tokens", max_tokens), ("block_length", block_length),
                            ("temperature", temperature), ("seed", seed), ("kv_routing", kv_routing),
                            ("kv_budget", kv_budget), ("settings", settings)):
            if name != "settings":
                check_type(name, value, self.__dataclass_fields__[name].type)
            object.__setattr__(self, name, value)
        check(max_tokens > 0, f"max_tokens must be positive, got {max_tokens}")
        check(block_length > 0, f"block_length must be positive, got {block_length}")
        check(temperature >= 0, f"temperature must be >= 0, got {temperature}")
        check(0 <= seed < 1 << 63, f"seed must be in [0, 2**63), got {seed}")
        check(kv_routing is None or kv_routing in POLICIES,
              f"kv_routing must be None or one of {', '.join(POLICIES)}, got {kv_routing!r}")
        check(kv_budget is None or kv_routing is not None,
              f"kv_budget ({kv_budget}) applies only with kv_routing ({', '.join(POLICIES)}); without one every "
              f"step reads the whole prompt")
        if kv_routing is not None and kv_budget is None:
            object.__setattr__(self, "kv_budget", kv_budget := DEFAULT_KV_BUDGET)
        check(kv_budget is None or 0 < kv_budget <= 1, f"kv_budget must be in (0, 1], got {kv_budget}")
        # (`parallel` keeps a cache on a block-causal model: the engine checks the model's variant)
        check(kv_routing is None or any(m.uses_cache for m in variants(method)), no_cache_to_route(method))
        decoding.validate(self)

    @property
    def routes_prompt(self) -> bool:
        """Whether steps read less than the whole prompt's KV (a routing, with a budget under 1)."""
        return self.kv_routing is not None and self.kv_budget < 1

    @property
    def num_blocks(self) -> int:
        """Blocks of the generated region, the last one shorter where max_tokens is not a multiple of block_length."""
        return -(-self.max_tokens // self.block_length)

    def batch_key(self) -> tuple:
        """Requests with equal keys can share a batch; per-row values (temperature, seed, a threshold or
        factor) may differ inside it."""
        return (self.method, self.max_tokens, self.block_length, self.settings.batch_key())

    def to_dict(self) -> dict:
        """The common fields and the method's knobs, flat (as keywords would give them)."""
        common = {name: getattr(self, name) for name in ("method", "max_tokens", "block_length", "temperature",
                                                         "seed", "kv_routing", "kv_budget")}
        return {**common, **dataclasses.asdict(self.settings)}


def no_cache_to_route(method: str) -> str:
    """The error of kv_routing with a method that keeps no KV cache."""
    return (f"kv_routing routes the KV cache's prompt keys: method {method!r} keeps no cache; use one of "
            f"{', '.join(m.name for m in METHODS.values() if m.uses_cache)}")


def _settings_from_keywords(method: str, given: dict):
    """The method's settings from keyword knobs; a knob that it does not read is an error naming who does."""
    settings = method_of(method).Settings
    own = {f.name for f in dataclasses.fields(settings)}
    for name in given.keys() - own:
        readers = [m.name for m in METHODS.values() if name in {f.name for f in dataclasses.fields(m.Settings)}]
        check(bool(readers), f"unknown setting {name!r}; the settings are {', '.join(knobs())}")
        raise ValueError(f"{name} applies to method {' or '.join(readers)}, not {method!r}")
    for first, second in settings.exclusive:
        check(not {first, second} <= given.keys(), f"give either {first} or {second}, not both")
    return settings(**given)


@dataclass(frozen=True)
class Knob:
    """A setting that some methods read: its type, allowed values, and each reader's help and default."""
    type: type
    choices: tuple | None
    symbol: str | None
    helps: dict[str, str]
    defaults: dict[str, Any]

    @property
    def help(self) -> str:
        """One help line, or each reader's where they differ (e.g. `steps` of reference and of dream)."""
        distinct = set(self.helps.values())
        if len(distinct) == 1:
            return distinct.pop()
        return "; ".join(f"{method}: {text}" for method, text in self.helps.items())


def knobs() -> dict[str, Knob]:
    """Every registered method's knobs by name, in registry order (the CLI flags and the sweep's axes)."""
    found: dict[str, Knob] = {}
    for method in METHODS.values():
        for f in dataclasses.fields(method.Settings):
            kind = {"int": int, "float": float}.get(str(f.type).split("|")[0].strip(), str)
            meta = f.metadata
            found.setdefault(f.name, Knob(kind, meta.get("choices"), meta.get("symbol"), {}, {}))
            found[f.name].helps[method.name] = meta["help"]
            found[f.name].defaults[method.name] = f.default
    return found
