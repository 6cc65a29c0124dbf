"""The table of decoding methods: name -> method. A new method is one module in decoding/ and one entry here
(or, from outside the package, one `register` call)."""
from __future__ import annotations

from .base import DecodingMethod
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
DEFAULT_METHOD = Parallel.name


def register(method: type[DecodingMethod]) -> type[DecodingMethod]:
    """Add a method (its class, with a unique `name`) to the table."""
    if method.name in METHODS:
        raise ValueError(f"a decoding method named {method.name!r} is already registered")
    METHODS[method.name] = method()
    return method


def method_of(name: str) -> DecodingMethod:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


for _method in (Reference, Parallel, PrefixCache, DualCache, FlashCache, FlashVerify, Elastic, Lossless, Dream):
    register(_method)
