"""Megatron-Core 0.19's row operations by hand, and the KV utilization statistics.

0.19's ``update_requests`` is built from steps its tests also call on their own:
``release_memory_blocks_from_request_indexes`` (the blocks of hand-picked rows go back to the
allocator; the rows keep everything else, as the caller then moves the counts by hand) and
``evict_overflow_paused_requests`` (the paused rows beyond the paused budget are evicted and
the rows compacted). Here each is a plan over the host rows, checked first, then committed as
every other change (``RequestTable.commit_update`` for the eviction), so a refused call changes
nothing. The eviction weighs a paused row by the blocks only it holds, as ``update_requests``
does (docs/SEMANTICS.md §17.4), so it evicts exactly what an update would.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ._fields import FIELD_IDS, FIELD_MAMBA_SLOT
from .block_allocator import AllocatorSimulation, StackSimulation
from .plan_scratch import PlanScratch
from .update_plan import UpdatePlan

_EMPTY = np.empty(0, dtype=np.int64)


def get_kvcache_utilization_stats(table) -> dict:
    """Block usage of the buffer and of the active requests; host only."""
    table.check_bound()
    alloc, num_paused, num_total = table.allocator, table.paused, table.total
    total = max(alloc.total_count - 1, 1)
    allocated = alloc.total_count - 1 - alloc.total_avail
    rows = table.block_table[num_paused:num_total]
    active_unique = int(np.unique(rows[rows >= 0]).size)
    return {
        "total_blocks": total, "allocated_blocks": allocated,
        "active_unique_blocks": active_unique, "allocated_utilization": allocated / total,
        "active_utilization": active_unique / total, "active_request_count":
            num_total - num_paused,
        "paused_request_count": num_paused, "paused_blocks": table.paused_used_blocks(),
        "block_count_avail": alloc.total_avail, "active_token_count": table.active_tokens,
        "total_request_count": num_total, "max_requests": table.request_limit,
    }


def _row_indexes(request_indexes: Any, max_requests: int) -> np.ndarray:
    """``request_indexes`` (a tensor, array or sequence of row indexes) as distinct int64 rows
    in ``[0, max_requests)``; ``TypeError``/``ValueError`` naming the argument otherwise."""
    if isinstance(request_indexes, torch.Tensor):
        if request_indexes.is_floating_point() or request_indexes.dtype == torch.bool:
            raise TypeError(f"request_indexes must hold integer row indexes, got dtype "
                            f"{request_indexes.dtype}")
        rows = request_indexes.detach().cpu().numpy()
    else:
        rows = np.asarray(request_indexes)
        if rows.size and (rows.dtype.kind not in "iu"):
            raise TypeError(f"request_indexes must hold integer row indexes, got "
                            f"{request_indexes!r}")
    rows = rows.astype(np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= max_requests):
        raise ValueError(f"request_indexes {rows.tolist()} must lie in [0, max_requests="
                         f"{max_requests}) (row indexes, not request ids)")
    if np.unique(rows).size != rows.size:
        raise ValueError(f"request_indexes {rows.tolist()} lists a row twice")
    return rows


class ReleasePlan(NamedTuple):
    rows: np.ndarray
    blocks: np.ndarray         # every block the rows hold (one entry per holding)
    slots: np.ndarray          # hybrids: the rows' Mamba slots
    ids: np.ndarray            # the rows' request ids


def plan_release_rows(table, request_indexes: Any) -> ReleasePlan:
    """``release_memory_blocks_from_request_indexes``' plan: the blocks the rows' block-table
    entries hold (the dummy block excluded) and their Mamba slots; refused when a block would
    lose more references than it has (a block table written by hand). Changes nothing."""
    table.check_bound()
    rows = _row_indexes(request_indexes, table.max_requests)
    allocator = table.allocator
    held = table.block_table[rows].astype(np.int64).reshape(-1)
    blocks = held[(held >= 0) & (held != allocator.dummy_block_idx)]
    if blocks.size:
        if blocks.max() >= allocator.total_count:
            raise ValueError(f"rows {rows.tolist()} hold block ids outside the allocator "
                             f"(total_count={allocator.total_count})")
        taken = np.bincount(blocks, minlength=allocator.total_count)
        over = np.flatnonzero(taken > allocator.ref_counts)
        if over.size:
            raise RuntimeError(f"release_memory_blocks_from_request_indexes(): blocks "
                               f"{over.tolist()} are held more often by rows {rows.tolist()} "
                               f"than they have references; nothing was released")
    slots = table.rows[FIELD_MAMBA_SLOT, rows] if table.hybrid else np.empty(0, np.int32)
    return ReleasePlan(rows, blocks, slots[slots >= 0].copy(), table.rows[FIELD_IDS, rows])


def commit_release_rows(table, plan: ReleasePlan) -> None:
    """Apply ``plan``: the blocks released (a reference each), the rows' block-table entries
    -1, their Mamba slots freed (the slot field -1); the rows keep their other fields."""
    table.allocator.release_memory_blocks(plan.blocks)
    table.block_table[plan.rows] = -1
    if plan.slots.size:
        table.slots.release(plan.slots)
    if table.hybrid:
        table.rows[FIELD_MAMBA_SLOT, plan.rows] = -1
    if table.prefix_cache is not None:   # their chains will not be computed further
        for rid in plan.ids.tolist():
            table.prefix_cache.pending.pop(int(rid), None)


def plan_evict_overflow(table, active_request_count: Any) -> Optional[UpdatePlan]:
    """``evict_overflow_paused_requests``' plan: the paused rows beyond the paused budget,
    from the right (the update's rule), released and moved past the active rows; None when
    nothing overflows. Changes nothing."""
    table.check_bound()
    if isinstance(active_request_count, bool) or \
            not isinstance(active_request_count, (int, np.integer)):
        raise TypeError(f"active_request_count={active_request_count!r} must be an int")
    if active_request_count != table.active:
        raise ValueError(f"active_request_count={active_request_count} must be the context's "
                         f"{table.active} active requests (total_request_count - "
                         "paused_request_count)")
    allocator = table.allocator
    scratch = PlanScratch(table, AllocatorSimulation(allocator) if allocator.keeps_idle_blocks
                          else StackSimulation(allocator))
    total, active = table.total, table.active
    paused, evicted = scratch.evict(table.paused, active, allocator.paused_count)
    if not evicted.size:
        return None
    slots = np.concatenate(scratch.slots) if scratch.slots else np.empty(0, dtype=np.int32)
    return UpdatePlan(
        old_paused=table.paused, old_total=total, paused=paused, total=paused + active,
        active_tokens=table.active_tokens, origin=scratch.origin, rows=scratch.fields,
        append_col=scratch.append_col, append_block=scratch.append_block,
        allocator_ops=tuple(scratch.stack.ops), released_slots=slots,
        finished_ids=_EMPTY, evicted_ids=evicted, newly_paused_ids=_EMPTY,
        max_length_ids=_EMPTY)


def check_callers_tokens(total: int, next_tokens: Any, new_speculative_tokens: Any) -> None:
    """``evict_overflow_paused_requests``' per-row tensors, before anything moves: None, or a
    tensor of at least the ``total`` rows (``next_tokens`` ``[total]``, its first dimension;
    ``new_speculative_tokens`` ``[k, total]``, its second)."""
    for name, value, dim in (("next_tokens", next_tokens, 0),
                             ("new_speculative_tokens", new_speculative_tokens, 1)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (one entry per row, moved with "
                            f"the rows) or None, got {type(value).__name__}")
        if value.dim() <= dim or value.shape[dim] < total:
            raise ValueError(f"{name} has shape {tuple(value.shape)}: it needs "
                             f"{'[total' if dim == 0 else '[k, total'} requests={total}] "
                             "entries, one per row, moved with the rows")


def move_callers_tokens(plan: UpdatePlan, next_tokens: Any,
                        new_speculative_tokens: Any = None) -> None:
    """0.19 moves the caller's per-row tensors with the rows: row ``r`` of ``next_tokens``
    (``[total]``) and column ``r`` of ``new_speculative_tokens`` (``[k, total]``) take the old
    row ``plan.origin[r]``'s."""
    origin = torch.from_numpy(plan.origin)
    if isinstance(next_tokens, torch.Tensor) and next_tokens.numel() >= plan.old_total:
        index = origin.to(next_tokens.device)
        next_tokens[:plan.old_total] = next_tokens[index].clone()
    if isinstance(new_speculative_tokens, torch.Tensor):
        index = origin.to(new_speculative_tokens.device)
        new_speculative_tokens[:, :plan.old_total] = new_speculative_tokens[:, index].clone()


class RowOps:
    """Megatron-Core 0.19's row operations on ``DynamicInferenceContext`` (a mixin over the
    facade's parts, as ``step_api.StepAPI``)."""

    def release_memory_blocks_from_request_indexes(self, request_indexes: Any) -> None:
        """Release the blocks of the rows ``request_indexes`` (row indexes, not request ids):
        a reference each (with prefix caching a cached block stays cached under "lru"), the
        rows' block-table entries -1 and, on a hybrid, their Mamba slots freed. The rows keep
        their ids, counts and lengths, as in 0.19: the caller moves the counts next (a state
        written by hand). Every check first: a refused call changes nothing."""
        self._check_allocated()
        plan = plan_release_rows(self._table, request_indexes)
        if not plan.rows.size:
            return
        commit_release_rows(self._table, plan)
        self._device.host_table_written = True
        self._device.arena.dirty = True
        self._forward.reset_attention_state()
        self._forward.step = self._step = None
        self._hand_written = True

    def evict_overflow_paused_requests(self, active_request_count: int, next_tokens: Any,
                                       new_speculative_tokens: Any = None
                                       ) -> Optional[torch.Tensor]:
        """Evict the paused requests beyond the paused budget, right-most first, as
        ``update_requests`` does (docs/SEMANTICS.md §9.4; with prefix caching a paused row
        weighs the blocks only it holds, §17.4); their blocks and slots are released and the
        rows move past the active ones. Returns the evicted request ids (int64 CPU) or None
        when nothing overflows. ``active_request_count`` must be the active rows (0.19 passes
        its running count); ``next_tokens`` (``[total]``) and ``new_speculative_tokens``
        (``[k, total]``), the caller's per-row tensors, move with the rows, as in 0.19. Every
        check first."""
        self._check_allocated()
        table, device = self._table, self._device
        plan = plan_evict_overflow(table, active_request_count)
        check_callers_tokens(table.total, next_tokens, new_speculative_tokens)
        if plan is None:
            return None
        pending = device.next_tokens[device.current][:plan.old_total]
        drafts = device.spec.drafts[:plan.old_total].t() if device.spec is not None else None
        table.commit_update(plan)
        if table.prefix_cache is not None:
            table.prefix_cache.drop_done(table.live_ids)
        device.apply_update(plan, table, pending, drafts)
        move_callers_tokens(plan, next_tokens, new_speculative_tokens)
        self._forward.reset_attention_state()
        self._forward.step = None
        self._after_async_change()
        return torch.from_numpy(plan.evicted_ids.astype(np.int64))
