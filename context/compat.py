"""Megatron-Core's constructor options and methods that dynctx accepts but does not support.

One table, one message each: the constructor hands every such option to ``check_options``, and
the methods that only exist for Megatron-Core's CUDA-graph and multi-GPU paths raise through
``unsupported``. Options not listed here are supported (or stored for the model, as Megatron-Core
stores them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Option:
    """An accepted-but-unsupported option: ``ok(value)`` says whether ``value`` is harmless;
    otherwise ``action`` (``"raise"``, ``"warn"`` or ``"deprecated"``) with ``message``."""

    ok: Callable[[Any], bool]
    action: str
    message: str


def _none_or_one(value: Any) -> bool:
    return value in (None, 1)


OPTIONS = {
    "pipeline_model_parallel_size": Option(
        _none_or_one, "raise", "pipeline_model_parallel_size={value} is not supported: dynctx "
        "runs one pipeline stage without context or expert parallelism (pass None or 1)"),
    "context_parallel_size": Option(
        _none_or_one, "raise", "context_parallel_size={value} is not supported: dynctx runs one "
        "pipeline stage without context or expert parallelism (pass None or 1)"),
    "expert_model_parallel_size": Option(
        _none_or_one, "raise", "expert_model_parallel_size={value} is not supported: dynctx "
        "runs one pipeline stage without context or expert parallelism (pass None or 1)"),
    "pg_collection": Option(
        lambda v: v is None, "raise",
        "pg_collection is not supported: pass tensor_model_parallel_size instead"),
    "persist_cuda_graphs": Option(
        lambda v: not v, "raise", "persist_cuda_graphs=True: CUDA graphs are not supported yet"),
    "offload_kv_cache": Option(
        lambda v: not v, "raise", "offload_kv_cache=True: KV offload is not supported"),
    "cuda_graph_max_tokens": Option(
        lambda v: v is None, "deprecated", "cuda_graph_max_tokens is deprecated and ignored"),
    "num_cuda_graphs": Option(
        lambda v: v is None, "warn",
        "num_cuda_graphs: CUDA graphs are not supported yet; running eager"),
}

METHODS = {
    "maybe_initialize_symmetric_memory": "maybe_initialize_symmetric_memory: symmetric memory "
    "for tensor-parallel all-reduce is not supported yet",
    "construct_graph_dimensions": "construct_graph_dimensions: CUDA graph capture is not "
    "supported yet (dynctx runs eager)",
}


def check_options(values: dict, *, stacklevel: int = 3) -> None:
    """Raise ``NotImplementedError`` or warn for each option of ``values`` the table lists."""
    for name, value in values.items():
        option = OPTIONS[name]
        if option.ok(value):
            continue
        message = option.message.format(value=value)
        if option.action == "raise":
            raise NotImplementedError(message)
        category = DeprecationWarning if option.action == "deprecated" else UserWarning
        warnings.warn(message, category, stacklevel=stacklevel)


def unsupported(method: str) -> NotImplementedError:
    """The error a Megatron-Core method dynctx does not support raises (``raise unsupported(..)``)."""
    return NotImplementedError(METHODS[method])
