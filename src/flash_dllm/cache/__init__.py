from .kv_cache import CacheAllocator, KVCache

__all__ = ["CacheAllocator", "KVCache"]
