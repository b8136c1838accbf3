"""longctx: paged int8/int4/int2 KV caches for long contexts on one GPU.

Thin re-exports; transformers is imported lazily (only when LongCtxCache/load_model are used).
"""

from .config import KVConfig
from .errors import BackendUnavailableError, CacheFullError, LongCtxError, ModelNotFoundError, SharedMemoryError, UnsupportedModelError

__version__ = "0.1.0"


def __getattr__(name):
    if name == "LongCtxCache":
        from .integrations.transformers import LongCtxCache

        return LongCtxCache
    if name == "load_model":
        from .models import load_model

        return load_model
    if name == "graph_decoding":
        from .generate import graph_decoding

        return graph_decoding
    if name == "PagedKVCache":
        from .cache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module 'longctx' has no attribute {name!r}")


__all__ = [
    "BackendUnavailableError",
    "CacheFullError",
    "KVConfig",
    "LongCtxCache",
    "LongCtxError",
    "ModelNotFoundError",
    "PagedKVCache",
    "SharedMemoryError",
    "UnsupportedModelError",
    "graph_decoding",
    "load_model",
]
