"""Megatron-Core's constructor options that dynctx accepts but does not support.

One table, one message each: the constructor hands every such option to ``check_options``.
Options not listed here are supported (or stored for the model, as Megatron-Core stores them).
The tensor- and pipeline-parallel groups are ``context/parallel.py``'s.
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
    return value is None or (value == 1 and not isinstance(value, bool))


OPTIONS = {
    "context_parallel_size": Option(
        _none_or_one, "raise", "context_parallel_size={value} is not supported: dynctx runs "
        "tensor and pipeline parallelism, not context or expert parallelism (pass None or 1)"),
    "expert_model_parallel_size": Option(
        _none_or_one, "raise", "expert_model_parallel_size={value} is not supported: dynctx "
        "runs tensor and pipeline parallelism, not context or expert parallelism (pass None "
        "or 1)"),
    "persist_cuda_graphs": Option(
        lambda v: not v, "raise",
        "persist_cuda_graphs={value!r}: CUDA graphs are not supported yet"),
    "offload_kv_cache": Option(
        lambda v: not v, "raise", "offload_kv_cache={value!r}: KV offload is not supported"),
    "cuda_graph_max_tokens": Option(
        lambda v: v is None, "deprecated", "cuda_graph_max_tokens is deprecated and ignored"),
}

#: The options that raise, checked first by the constructor (``cuda_graph_max_tokens`` only warns,
#: once the other arguments are checked).
REFUSED = ("context_parallel_size", "expert_model_parallel_size", "persist_cuda_graphs",
           "offload_kv_cache")


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
