"""The table of decoding methods: name -> method. A new method is one module in decoding/ and one entry here
(or, from outside the package, one `register` call). A name may mean another method on a block-causal model
(BLOCK_CAUSAL: `parallel` is then LLaDA2.0's sampler over the exact block cache)."""
from __future__ import annotations

from .base import DecodingMethod
from .block_diffusion import BlockFlashCache, BlockFlashVerify, DraftAndEdit, LLaDA2Threshold
from .diffusion_generate import Dream
from .dual_cache import DualCache
from .elastic import Elastic
from .flash_cache import FlashCache
from .flash_verify import FlashVerify
from .lossless import Lossless
from .parallel import Parallel
from .prefix_cache import PrefixCache
from .reference import Reference

METHODS: dict[str, DecodingMethod] = {}
BLOCK_CAUSAL: dict[str, DecodingMethod] = {method.name: method()
                                           for method in (LLaDA2Threshold, BlockFlashCache, BlockFlashVerify)}
DEFAULT_METHOD = Parallel.name


def register(method: type[DecodingMethod]) -> type[DecodingMethod]:
    """Add a method (its class, with a unique `name`) to the table."""
    if method.name in METHODS:
        raise ValueError(f"a decoding method named {method.name!r} is already registered")
    METHODS[method.name] = method()
    return method


def methods_for(attention: str) -> list[str]:
    """The names of the methods that decode a model of `attention` (config.ATTENTION_KINDS)."""
    return [name for name in METHODS if attention in method_of(name, attention).attention_patterns]


def variants(name: str) -> list[DecodingMethod]:
    """The method `name` on each kind of attention that has its own (METHODS', then BLOCK_CAUSAL's)."""
    return [METHODS[name]] + ([BLOCK_CAUSAL[name]] if name in BLOCK_CAUSAL else [])


def method_of(name: str, attention: str = "bidirectional") -> DecodingMethod:
    """The method `name` on a model of `attention` (config.ATTENTION_KINDS)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return BLOCK_CAUSAL[name] if attention == "block-causal" and name in BLOCK_CAUSAL else METHODS[name]


for _method in (Reference, Parallel, PrefixCache, DualCache, FlashCache, FlashVerify, Elastic, Lossless, Dream,
                DraftAndEdit):
    register(_method)
