"""The descriptors the facade (``dynamic_context.py``) declares its Megatron-Core names with:
``_Part`` (a method that is one part's method), and the properties over the request table and
the device state (``_table_count``, ``_step_tensor``, ``_row_field``). They read the facade's
parts (``_table``, ``_device``) and nothing else."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class _Part:
    """A Megatron method whose whole work is ``function`` on one part: ``ctx.<name>`` is
    ``function`` bound to ``ctx.<part>`` (a method of the part, or a function of the part's
    module taking it first), so ``help`` and ``inspect`` show the function's docstring and
    signature, and a call costs what a call of the part's method does."""

    def __init__(self, part: str, function: Any):
        self.part, self.function, self.__doc__ = part, function, function.__doc__

    def __get__(self, ctx: Any, owner: Any = None) -> Any:
        if ctx is None:
            return self.function
        return self.function.__get__(getattr(ctx, self.part))


def _table_count(field: str, limit: str, doc: str) -> property:
    """A count of the request table, settable by hand as Megatron-Core code sets its attributes
    (its tests build states that way); ``limit`` names the context attribute bounding it."""

    def set(self, value: int) -> None:
        name = doc.split(":")[0]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}={value!r} must be an int")
        if "_table" not in self.__dict__:  # a bare instance (``__new__``), as 0.19's tests use
            self.__dict__[f"_bare_{field}"] = int(value)
            return
        high = getattr(self, limit)
        if not 0 <= value <= high:
            raise ValueError(f"{name}={value} must lie in [0, {limit}={high}]")
        setattr(self._table, field, int(value))
        # A state written by hand is the caller's: update_requests takes it as forwarded.
        self._hand_written = True

    def get(self) -> int:
        table = self.__dict__.get("_table")
        return self.__dict__.get(f"_bare_{field}", 0) if table is None else getattr(table, field)

    return property(get, set, doc=doc)


def _step_tensor(name: str) -> property:
    """A per-token array of the step (``DeviceState``; None while suspended). Read before
    ``initialize_attention_state`` of this step, it builds the step first (Megatron-Core fills
    these arrays in ``add_request``/``update_requests``); after it, one check and no work."""

    def get(self):
        device = self._device
        if self._step is None and device.allocated:
            self._materialize_step()
        return getattr(device, name)

    return property(get, doc=f"{name}: per-token array of the step, [max_tokens]")


def _row_field(field: int, doc: str) -> property:
    """One per-request field, int32 ``[max_requests]`` (``DeviceState.field_view``: a host
    view on a CPU device, the device mirror on CUDA)."""
    return property(lambda self: self._device.field_view(self._table, field), doc=doc)


def _prefix_stat(name: str) -> property:
    """One of Megatron-Core 0.19's prefix-cache counters: a view of the prefix cache's
    statistics (``PrefixCacheStats``), settable as 0.19's engine drains them; 0 without prefix
    caching, where a write is kept on the context."""

    def get(self) -> int:
        cache = self.__dict__.get("prefix_cache")
        return getattr(cache.stats, name) if cache is not None else self.__dict__.get(
            f"_bare_{name}", 0)

    def set(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
        cache = self.__dict__.get("prefix_cache")
        if cache is None:
            self.__dict__[f"_bare_{name}"] = int(value)
        else:
            setattr(cache.stats, name, int(value))

    return property(get, set, doc=f"{name}: Megatron-Core 0.19's prefix-cache counter")


def get_active_sequence_lengths(self) -> torch.Tensor:
    """int32 ``[active]``: tokens in the KV cache after this step, per active request."""
    paused, total = self.paused_request_count, self.total_request_count
    return (self.request_kv_length_offsets[paused:total]
            + self.request_query_lengths[paused:total])


def get_max_sequence_lengths(self) -> torch.Tensor:
    """int32 ``[active]`` view: each active request's target total length."""
    return self.request_output_lengths[self.paused_request_count:self.total_request_count]
