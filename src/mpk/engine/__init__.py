"""The engine: KV-cache pages, the host decode loop, stop rules and greedy generation."""

from mpk.engine.decode import GenerationResult, InvalidRequestError
from mpk.engine.engine import Engine, EngineConfig
from mpk.engine.kv_cache import KvCache, KvShape, OutOfPagesError, PagePool

__all__ = ["Engine", "EngineConfig", "GenerationResult", "InvalidRequestError", "KvCache",
           "KvShape", "OutOfPagesError", "PagePool"]
