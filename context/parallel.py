"""Tensor- and pipeline-parallel groups of a context, and the one construction-time agreement.

A context on a tensor-parallel rank stores its shard of the KV heads (or the whole MLA latent,
or its shard of the Mamba heads); a context on a pipeline stage stores its own layers. Every
rank runs the same host bookkeeping on the same requests, so their block allocators must be
identical: ``agree_counts`` reduces the block counts with MIN over the tensor and the pipeline
group, once, at construction (docs/DESIGN.md, "Tensor and pipeline parallelism"). No step
communicates.

Where the groups come from, first match wins:

1. ``pg_collection`` (Megatron-Core's ``ProcessGroupCollection``, or any object with ``tp`` /
   ``pp`` process groups);
2. Megatron-Core's ``parallel_state`` when the caller has imported and initialised it (read
   only then: dynctx never imports megatron-core itself); a group whose size disagrees with an
   explicit ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` is not used;
3. the default ``torch.distributed`` group, for tensor parallelism only, when it has exactly
   ``tensor_model_parallel_size`` ranks.

``tensor_model_parallel_size > 1`` without ``torch.distributed`` is a single process that holds
one rank's shard (sizing only: nothing is reduced).
"""

from __future__ import annotations

import functools
import hashlib
import numbers
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class ParallelGroups:
    """``tp``/``pp``: sizes; ``tp_group``/``pp_group``: process groups (None for one rank, or
    for tensor parallelism without ``torch.distributed``)."""

    tp: int
    pp: int
    tp_group: Any = None
    pp_group: Any = None

    @property
    def groups(self) -> tuple:
        """The groups the block counts are reduced over (tensor first, then pipeline)."""
        return tuple(g for g in (self.tp_group, self.pp_group) if g is not None)


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _group_size(group: Any, name: str) -> int:
    import torch.distributed as dist

    if not _distributed_ready():
        raise ValueError(f"{name} is given but torch.distributed is not initialized")
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"{name}={group!r} is not a process group of this process: "
                         f"{error}") from None


def _size_arg(name: str, value: Any) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be an int >= 1 or None")
    return value


def _megatron_groups() -> tuple:
    """``(tp group, pp group)`` of Megatron-Core's ``parallel_state`` when the process has
    imported and initialised it, else ``(None, None)``."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not _distributed_ready():
        return None, None
    try:
        if not ps.model_parallel_is_initialized():
            return None, None
        return ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    except (AssertionError, AttributeError, RuntimeError):
        return None, None


def _check_size(name: str, given: Optional[int], group_name: str, size: int) -> None:
    if given is not None and given != size:
        raise ValueError(f"{name}={given} but {group_name} has {size} ranks")


def parallel_groups(*, tensor_model_parallel_size: Any, pipeline_model_parallel_size: Any,
                    pg_collection: Any) -> ParallelGroups:
    """The context's ``ParallelGroups`` from its constructor arguments (module docstring)."""
    tp = _size_arg("tensor_model_parallel_size", tensor_model_parallel_size)
    pp = _size_arg("pipeline_model_parallel_size", pipeline_model_parallel_size)
    tp_group = pp_group = None
    if pg_collection is not None:
        source = "pg_collection"
        tp_group = getattr(pg_collection, "tp", None)
        pp_group = getattr(pg_collection, "pp", None)
    else:
        source = "Megatron-Core's parallel_state"
        tp_group, pp_group = _megatron_groups()
    if pg_collection is None:
        # Megatron-Core's global groups are a fallback: an explicit size that disagrees wins
        # (as in Megatron-Core, which reads the explicit sizes first), and its group is unused.
        if tp is not None and tp_group is not None and _group_size(tp_group, "tp") != tp:
            tp_group = None
        if pp is not None and pp_group is not None and _group_size(pp_group, "pp") != pp:
            pp_group = None
    if tp_group is not None:
        size = _group_size(tp_group, f"{source}.tp")
        _check_size("tensor_model_parallel_size", tp, f"{source}.tp", size)
        tp, tp_group = size, (tp_group if size > 1 else None)
    if pp_group is not None:
        size = _group_size(pp_group, f"{source}.pp")
        _check_size("pipeline_model_parallel_size", pp, f"{source}.pp", size)
        pp, pp_group = size, (pp_group if size > 1 else None)
    tp, pp = tp or 1, pp or 1
    if pp > 1 and pp_group is None:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} needs the pipeline's process group as "
            "pg_collection.pp (pg_collection=ProcessGroupCollection(pp=group, ...) or any "
            "object with .pp), or Megatron-Core's parallel_state initialised")
    if tp > 1 and tp_group is None and _distributed_ready():
        import torch.distributed as dist

        world = dist.get_world_size()
        if world != tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} but the default torch.distributed group has "
                f"{world} ranks: pass the tensor-parallel group as pg_collection.tp (or "
                "initialise Megatron-Core's parallel_state)")
        tp_group = dist.group.WORLD
    return ParallelGroups(tp=tp, pp=pp, tp_group=tp_group, pp_group=pp_group)


def min_over_groups(values: Sequence[int], groups: Sequence[Any]) -> list:
    """``values``' element-wise minimum over the ranks of every group in ``groups`` (one
    all-reduce per group; a gloo group reduces on the CPU, an NCCL group on the current CUDA
    device). Over a tensor group then a pipeline group this is the minimum over the whole
    grid."""
    import torch
    import torch.distributed as dist

    out = [int(v) for v in values]
    for group in groups:
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        tensor = torch.tensor(out, dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        out = [int(v) for v in tensor.tolist()]
    return out


# Integers within this bound are compared as themselves; any other value by a digest mapped
# below -_SHOWN (and above -2**63), so that a digest never equals a shown integer.
_SHOWN = 2 ** 62


def _agreement_value(value: Any) -> int:
    """The int that stands for ``value`` in the agreement: an integer (a bool, a numpy int) as
    itself; anything else (a float, a string, None, a tuple) by a 56-bit digest of its type and
    ``repr``, below ``-_SHOWN``."""
    if isinstance(value, numbers.Integral) and -_SHOWN < int(value) < _SHOWN:
        return int(value)
    digest = hashlib.sha256(f"{type(value).__name__}:{value!r}".encode()).digest()
    return -_SHOWN - int.from_bytes(digest[:7], "little")


def agree_counts(counts: Sequence[int], same: dict, groups: Sequence[Any],
                 what: str = "build their contexts") -> list:
    """``counts`` reduced with MIN over ``groups``; in the same all-reduce, check that every
    value of ``same`` (name -> value, e.g. an explicit ``max_requests``; ints compared as
    themselves, other values by a digest of their ``repr``) is equal on every rank (min ==
    max), else ``ValueError`` naming it (and ``what`` the ranks did), on every rank alike."""
    names = list(same)
    values = [_agreement_value(same[n]) for n in names]
    reduced = min_over_groups(list(counts) + values + [-v for v in values], groups)
    k, m = len(counts), len(names)
    lows, highs = reduced[k:k + m], [-v for v in reduced[k + m:]]
    # The same words on every rank: a digest (on any rank) is not shown.
    differ = [f"{n} (from {lo} to {hi})" if lo > -_SHOWN else f"{n} (differs between ranks)"
              for n, lo, hi in zip(names, lows, highs) if lo != hi]
    if differ:
        raise ValueError(f"the tensor/pipeline-parallel ranks must {what} with the same "
                         + ", ".join(differ) + ": every rank runs the same bookkeeping")
    return reduced[:k]


class CountAgreement:
    """The context's ``reduce_counts`` (``context.sizing.memory_layout``): ``agree_counts``
    over ``groups`` of the block counts and of ``extra`` counts (reduced with MIN alike, read
    back from ``self.extra``), with the sizes ``memory_layout`` passes and the settings of
    ``same`` checked equal, all in one all-reduce. Without groups ``extra`` stays as given.

    Before it, every rank checks in (``check_in``, a one-number all-reduce): a rank that raised
    while checking its own arguments (``joins_agreement_on_failure``) checks in as failed and
    raises its error; the others then raise too, naming it, instead of waiting in an
    all-reduce that rank never joins. After the constructor every rank checks out the same
    way (``check_out``), so that a rank that raised after the agreement stops the others."""

    def __init__(self, groups: Sequence[Any], extra: Sequence[int] = (),
                 same: Optional[dict] = None, what: str = "build their contexts"):
        self.groups, self.extra, self.same = tuple(groups), list(extra), dict(same or {})
        self.what, self.checked_in, self.stopped = what, False, False

    def _any_failed(self, ok: bool) -> int:
        """One MIN all-reduce of "this rank failed": the failed rank (the highest), or -1."""
        import torch.distributed as dist

        if not self.groups:
            return -1
        return -min_over_groups([0 if ok else -(dist.get_rank() + 1)], self.groups)[0] - 1

    def check_in(self, ok: bool = True) -> None:
        """Join the check-in (every rank of the groups must); ``RuntimeError`` on the ranks
        that are fine when another one failed."""
        self.checked_in = True
        failed = self._any_failed(ok)
        self.stopped = failed >= 0
        if failed >= 0 and ok:
            raise RuntimeError(
                f"tensor/pipeline-parallel rank {failed} raised while its arguments were "
                f"checked, before the ranks could {self.what} together (that rank's error names "
                "the argument); every rank stops")

    def check_out(self, ok: bool) -> None:
        """After the constructor (every rank that checked in, unless the check-in stopped
        them): ``RuntimeError`` on the ranks that are fine when another one raised after the
        agreement (an allocation, a check of the agreed sizes)."""
        if not self.checked_in or self.stopped:
            return
        self.stopped = True
        failed = self._any_failed(ok)
        if failed >= 0 and ok:
            raise RuntimeError(
                f"tensor/pipeline-parallel rank {failed} raised after the ranks agreed, before "
                f"they could {self.what} together (that rank's error says why); every rank "
                "stops")

    def __call__(self, counts: Sequence[int], same: dict) -> list:
        self.check_in()
        reduced = agree_counts(list(counts) + self.extra, dict(same, **self.same), self.groups,
                               self.what)
        self.extra = reduced[len(counts):]
        return reduced[:len(counts)]


def joins_agreement_on_failure(init: Callable) -> Callable:
    """Decorates a constructor that sets ``self._agreement`` (a ``CountAgreement``) once its
    groups are known: when the constructor raises before this rank checked in, the rank checks
    in as failed; once checked in, every rank checks out at the end, as failed when it raised
    (the other ranks then raise too, instead of hanging in the next collective), and the error
    propagates. ``self._agreement`` is dropped when the constructor returns."""

    @functools.wraps(init)
    def constructor(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            agreement = self.__dict__.pop("_agreement", None)
            if agreement is not None and not agreement.checked_in:
                agreement.check_in(ok=False)
            elif agreement is not None:
                agreement.check_out(ok=False)
            raise
        agreement = self.__dict__.pop("_agreement", None)
        if agreement is not None:
            agreement.check_out(ok=True)

    return constructor
