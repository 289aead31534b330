"""The engine: requests, continuous batching over a compiled plan, KV-cache pages, stop rules."""

from mpk.engine.engine import Engine, EngineConfig
from mpk.engine.kv_cache import KvCache, KvShape, OutOfPagesError, PagePool
from mpk.engine.requests import (FinishReason, GenerationResult, InvalidRequestError,
                                 RequestHandle, RequestResult, SamplingParams)

__all__ = ["Engine", "EngineConfig", "FinishReason", "GenerationResult", "InvalidRequestError",
           "KvCache", "KvShape", "OutOfPagesError", "PagePool", "RequestHandle", "RequestResult",
           "SamplingParams"]
