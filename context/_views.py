"""Read-only views of the context's state (Megatron-Core's attributes and queries).

The mixin reads the context's ``_table`` (``request_table.RequestTable``), ``_device``
(``device_state.DeviceState``) and ``active_attn_metadata``; it changes nothing but uploads
pending host rows before handing out a device view.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from ._fields import (
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_OUTPUT,
    FIELD_QUERY,
)


def _table_count(field: str, limit: str, doc: str) -> property:
    """A count of the request table, settable by hand as Megatron-Core code sets its attributes
    (its tests build states that way); ``limit`` names the context attribute bounding it."""

    def get(self) -> int:
        return getattr(self._table, field)

    def set(self, value: int) -> None:
        name = doc.split(":")[0]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}={value!r} must be an int")
        high = getattr(self, limit)
        if not 0 <= value <= high:
            raise ValueError(f"{name}={value} must lie in [0, {limit}={high}]")
        setattr(self._table, field, int(value))
        # A state written by hand is the caller's: update_requests takes it as forwarded.
        self._hand_written = True

    return property(get, set, doc=doc)


def _step_tensor(name: str) -> property:
    """A per-token array of the step (``DeviceState``; None while suspended). Read before
    ``initialize_attention_state`` of this step, it builds the step first (Megatron-Core fills
    these arrays in ``add_request``/``update_requests``); after it, one check and no work."""

    def get(self):
        if self._step is None and self._device is not None:
            self._materialize_step()
        return None if self._device is None else getattr(self._device, name)

    return property(get, doc=f"{name}: per-token array of the step, [max_tokens]")


def _device_tensor(name: str) -> property:
    """A device tensor of ``DeviceState`` (None while the context is suspended)."""
    return property(lambda self: None if self._device is None else getattr(self._device, name))


class StateViewsMixin:
    """Counts, per-request device fields, host mirrors, step queries and usage stats."""

    token_to_input_ids = _step_tensor("token_to_input_ids")
    token_to_pos_ids = _step_tensor("token_to_pos_ids")
    token_to_request_idx = _step_tensor("token_to_request_idx")
    token_to_block_idx = _step_tensor("token_to_block_idx")
    token_to_position_in_request = _step_tensor("token_to_position_in_request")
    token_to_local_position_within_kv_block = _step_tensor(
        "token_to_local_position_within_kv_block")
    memory_buffer = _device_tensor("memory_buffer")
    mamba_conv_states = _device_tensor("mamba_conv_states")
    mamba_ssm_states = _device_tensor("mamba_ssm_states")
    total_request_count = _table_count(
        "total", "_request_rows", "total_request_count: rows in use (paused + active)")
    # Bounded by the rows, not by each other: Megatron's tests set them in any order.
    paused_request_count = _table_count(
        "paused", "_request_rows", "paused_request_count: rows [0, paused) are paused")
    active_token_count = _table_count(
        "active_tokens", "max_tokens", "active_token_count: tokens of the next forward pass")
    num_prefill_requests = _table_count(
        "num_prefill", "_request_rows", "num_prefill_requests: prefill rows of the step")
    num_decode_requests = property(lambda self: self._table.num_decode)
    _live_ids = property(lambda self: self._table.live_ids)
    _mamba_slots = property(lambda self: self._table.slots)
    _h_req = property(lambda self: self._table.rows)
    _arena = property(lambda self: None if self._device is None else self._device.arena)

    def _materialize_step(self) -> None:
        """Build this step's arrays now if there is a step to build: requests are active and
        the counts were not written by hand (a hand-written state has no consistent step)."""
        if self._table.active and not self._hand_written:
            self.initialize_attention_state()

    def _device_field(self, field: int) -> torch.Tensor:
        """One per-request field, int32 ``[max_requests]``: on a CPU device a view of the host
        row (writes reach the host, which is authoritative, at once); on CUDA the device mirror
        (writes need ``pull_bookkeeping_from_device()``)."""
        self._check_allocated()
        if self._host_views:
            return torch.from_numpy(self._table.rows[field])
        self._device.sync()
        return self._device.arena.device["req"][field]

    request_ids = property(lambda self: self._device_field(FIELD_IDS),
                           doc="int32 [max_requests]: request id per row (-1 free)")
    request_query_lengths = property(lambda self: self._device_field(FIELD_QUERY))
    request_output_lengths = property(lambda self: self._device_field(FIELD_OUTPUT))
    request_kv_length_offsets = property(lambda self: self._device_field(FIELD_KV_OFFSET))
    request_kv_block_counts = property(lambda self: self._device_field(FIELD_BLOCKS))
    request_last_kv_block_id = property(lambda self: self._device_field(FIELD_LAST_BLOCK))
    request_last_kv_block_offset = property(lambda self: self._device_field(FIELD_LAST_OFFSET))

    @property
    def request_to_kv_block_ids(self) -> torch.Tensor:
        """int32 ``[max_requests, max_kv_block_count]`` block table (-1 unused). On a CPU
        device a view of the host table: writes reach the host at once and the device mirror
        at the next step or update; on CUDA the device table (see
        ``pull_bookkeeping_from_device``)."""
        self._check_allocated()
        if self._host_views:
            self._device.host_table_written = True
            return torch.from_numpy(self._table.block_table)
        self._device.flush_block_rows(self._table)
        return self._device.block_table

    @property
    def request_metadata(self) -> dict[str, torch.Tensor]:
        """Per-label tensors ``[max_requests]`` of the request metadata (host views on a CPU
        device, as the per-request fields)."""
        self._check_allocated()
        if self._host_views:
            return {label: torch.from_numpy(self._table.metadata[label])
                    for label, _, _ in self.request_metadata_types}
        self._device.sync()
        return {label: self._device.arena.device[f"meta:{label}"]
                for label, _, _ in self.request_metadata_types}

    def pull_bookkeeping_from_device(self) -> None:
        """Copy the per-request bookkeeping tensors (``request_*`` fields, the Mamba slot map,
        ``request_metadata``, ``request_to_kv_block_ids``) from the device back to the host.

        The host holds the authoritative copy. Code that writes these tensors by hand on a CUDA
        device (as Megatron-Core's tests do) calls this after its writes and before the next
        ``add_request``/``update_requests``/step, which then see them. One device-to-host copy
        of each (a sync). On a CPU device the tensors are views of the host arrays and this
        does nothing."""
        self._check_allocated()
        if self._host_views:
            return
        device, table = self._device, self._table
        if device.arena.dirty:
            raise RuntimeError(
                "pull_bookkeeping_from_device(): the host changed after the device tensors were "
                "last handed out (an add_request or update in between); write them by hand "
                "after the host's last change, then pull")
        device.flush_block_rows(table)
        table.rows[:] = device.arena.device["req"].cpu().numpy()
        for label in table.metadata_labels:
            table.metadata[label][:] = device.arena.device[f"meta:{label}"].cpu().numpy()
        table.block_table[:] = device.block_table.cpu().numpy()

    @property
    def paused_tokens(self) -> Optional[torch.Tensor]:
        """Pending next input token of each paused request (a view), or None."""
        if self.paused_request_count == 0:
            return None
        return self._device.next_tokens[self._device.current][:self.paused_request_count]

    @paused_tokens.setter
    def paused_tokens(self, tokens: Optional[torch.Tensor]) -> None:
        """Write the pending tokens of the first ``len(tokens)`` paused rows (Megatron-Core's
        tests build paused states this way); None changes nothing (Megatron's reset value)."""
        if tokens is None:
            return
        self._check_allocated()
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or \
                tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"paused_tokens must be a 1-D integer tensor of token ids, got "
                            f"{tokens!r}")
        if tokens.numel() > self.paused_request_count:
            raise ValueError(f"paused_tokens has {tokens.numel()} tokens, more than "
                             f"paused_request_count={self.paused_request_count}")
        self._device.next_tokens[self._device.current][:tokens.numel()].copy_(tokens)

    @property
    def kv_block_counts_host(self) -> np.ndarray:
        """Host copy of the per-row block counts (no sync)."""
        self._check_allocated()
        return self._table.rows[FIELD_BLOCKS]

    @property
    def block_table_host(self) -> np.ndarray:
        """Host copy of the block table (no sync)."""
        self._check_allocated()
        return self._table.block_table

    def host_request_ids(self) -> np.ndarray:
        """Host copy of the request id of each row in ``[0, total_request_count)``."""
        self._check_allocated()
        return self._table.ids()

    # ------------------------------------------------------------------ simple queries
    def is_static_batching(self) -> bool:
        return False

    def is_decode_only(self) -> bool:
        return self.num_prefill_requests == 0

    def using_cuda_graph_this_step(self) -> bool:
        """Whether this step's padded dimensions are one of the context's CUDA graphs."""
        return self._using_cuda_graph_this_step

    def has_unfinished_requests(self) -> bool:
        return self.total_request_count > 0

    def get_active_request_count(self) -> int:
        return self.total_request_count - self.paused_request_count

    def _require_attention_state(self, method: str):
        self._check_allocated()
        if self.active_attn_metadata is None:
            raise RuntimeError(f"{method}() is valid only between initialize_attention_state() "
                               "and the next update_requests()/reset_attention_state()")
        return self.active_attn_metadata

    def cu_query_lengths(self) -> Tuple[torch.Tensor, int]:
        """``(cu_query_lengths [padded_requests + 1] int32, max_seqlen_q)``."""
        meta = self._require_attention_state("cu_query_lengths")
        return meta.cu_query_seq_lengths, meta.max_seqlen_q

    def cu_kv_lengths(self) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """``(cu_kv_lengths [padded_requests + 1], kv_seq_lengths [padded_requests],
        max_seqlen_k)``."""
        meta = self._require_attention_state("cu_kv_lengths")
        return meta.cu_kv_seq_lengths, meta.kv_seq_lengths, meta.max_seqlen_k

    def get_active_sequence_lengths(self) -> torch.Tensor:
        """int32 ``[active]``: tokens in the KV cache after this step, per active request."""
        P, T = self.paused_request_count, self.total_request_count
        return self.request_kv_length_offsets[P:T] + self.request_query_lengths[P:T]

    def get_max_sequence_lengths(self) -> torch.Tensor:
        """int32 ``[active]`` view: each active request's target total length."""
        P, T = self.paused_request_count, self.total_request_count
        return self.request_output_lengths[P:T]

    def get_index_of_chunked_prefill_request(self) -> int:
        """Row of the chunked prefill request (always the last active row), or -1."""
        if self.chunked_prefill_request_id == -1:
            return -1
        return self.total_request_count - 1

    # ------------------------------------------------------------------ stats
    def get_kvcache_utilization_stats(self) -> dict:
        """Block usage of the buffer and of the active requests; host only."""
        self._check_allocated()
        alloc, table = self.block_allocator, self._table
        total = max(alloc.total_count - 1, 1)
        allocated = alloc.total_count - 1 - alloc.total_avail
        P, T = table.paused, table.total
        rows = table.block_table[P:T]
        active_unique = int(np.unique(rows[rows >= 0]).size)
        return {
            "total_blocks": total, "allocated_blocks": allocated,
            "active_unique_blocks": active_unique, "allocated_utilization": allocated / total,
            "active_utilization": active_unique / total, "active_request_count": T - P,
            "paused_request_count": P, "paused_blocks": table.paused_used_blocks(),
            "block_count_avail": alloc.total_avail, "active_token_count": table.active_tokens,
            "total_request_count": T, "max_requests": self.max_requests,
        }
