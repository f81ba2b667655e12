"""Megatron-Core's constructor options that dynctx accepts but does not support, and its
parallel groups.

One table, one message each: the constructor hands every such option to ``check_options``.
Options not listed here are supported (or stored for the model, as Megatron-Core stores them).
``parallel_groups`` reads the pipeline (and tensor-parallel) group of ``pg_collection`` and
``min_over_group`` reduces the block count over the pipeline.
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
    "context_parallel_size": Option(
        _none_or_one, "raise", "context_parallel_size={value} is not supported: dynctx runs one "
        "pipeline stage without context or expert parallelism (pass None or 1)"),
    "expert_model_parallel_size": Option(
        _none_or_one, "raise", "expert_model_parallel_size={value} is not supported: dynctx "
        "runs one pipeline stage without context or expert parallelism (pass None or 1)"),
    "persist_cuda_graphs": Option(
        lambda v: not v, "raise", "persist_cuda_graphs=True: CUDA graphs are not supported yet"),
    "offload_kv_cache": Option(
        lambda v: not v, "raise", "offload_kv_cache=True: KV offload is not supported"),
    "cuda_graph_max_tokens": Option(
        lambda v: v is None, "deprecated", "cuda_graph_max_tokens is deprecated and ignored"),
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


def _group_size(group: Any, name: str) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name} is given but torch.distributed is not initialized")
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"{name}={group!r} is not a process group of this process: "
                         f"{error}") from None


def parallel_groups(*, pipeline_model_parallel_size: Any, tensor_model_parallel_size: Any,
                    pg_collection: Any) -> tuple:
    """``(pp_size, pipeline group or None, tp_size or None)`` from the constructor's arguments.

    dynctx reads no global parallel state: a pipeline of more than one stage needs its group as
    ``pg_collection.pp`` (Megatron-Core's ``ProcessGroupCollection``, or any object with a
    ``pp`` process group). ``pg_collection.tp`` gives the tensor-parallel size when
    ``tensor_model_parallel_size`` is None."""
    pp = pipeline_model_parallel_size
    if pp is not None and (isinstance(pp, bool) or not isinstance(pp, int) or pp < 1):
        raise ValueError(f"pipeline_model_parallel_size={pp!r} must be an int >= 1 or None")
    group, tp = None, None
    if pg_collection is not None:
        if tensor_model_parallel_size is None and getattr(pg_collection, "tp", None) is not None:
            tp = _group_size(pg_collection.tp, "pg_collection.tp")
        pp_group = getattr(pg_collection, "pp", None)
        if pp_group is not None:
            size = _group_size(pp_group, "pg_collection.pp")
            if pp is not None and pp != size:
                raise ValueError(f"pipeline_model_parallel_size={pp} but pg_collection.pp has "
                                 f"{size} ranks")
            pp, group = size, (pp_group if size > 1 else None)
    pp = 1 if pp is None else pp
    if pp > 1 and group is None:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} needs the pipeline's process group as "
            "pg_collection.pp (dynctx reads no global parallel state): pass "
            "pg_collection=ProcessGroupCollection(pp=group, ...) or any object with .pp")
    return pp, group, tp


def min_over_group(value: int, group: Any) -> int:
    """``value``'s minimum over the ranks of ``group`` (one all-reduce; a gloo group reduces
    on the CPU, an NCCL group on the current CUDA device)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())
