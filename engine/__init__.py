"""dynctx.engine: a small reference engine (in-flight batching, chunked prefill, sampling, CUDA
graph capture and replay)."""

from .engine import Engine, EngineStats, RequestResult, StepResult
from .sampling import sample

__all__ = ["Engine", "EngineStats", "RequestResult", "StepResult", "sample"]
