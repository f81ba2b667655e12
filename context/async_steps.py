"""Megatron-Core 0.19's async-scheduling trio on the request table (docs/SEMANTICS.md §16).

0.19's engine overlaps a decode-only step's CPU bookkeeping with the forward pass:
``resolve_requests(mask)`` finishes and compacts rows without advancing them,
``prepare_requests()`` advances every active decode row by the tokens it forwarded and takes a
new block for each row whose next ``1 + k`` tokens cross into one (no pause, no eviction: it
raises instead), and ``commit_sampled_tokens`` writes the sampled tokens as the next step's
inputs. Here those are plans over the host rows, as every other change of the table: each
``plan_*`` checks everything and changes nothing, and the facade then commits the host rows
(``RequestTable.commit_update`` for a resolve) and the device (``DeviceState``).

A prepared row is the row ``update_requests`` would leave: KV offset advanced by its query
length, query length ``1 + k``, last-block offset that of its next step's last token, and the
block taken early as §19 takes it. The step built next (``initialize_attention_state``) reads
the same rows, so the two scheduling modes meet in one layout.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ._fields import (
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_QUERY,
)
from .block_allocator import AllocatorSimulation, StackSimulation
from .plan_scratch import PlanScratch
from .update_plan import UpdatePlan

_EMPTY = np.empty(0, dtype=np.int64)


def rows_requiring_new_block(table) -> np.ndarray:
    """Host bool ``[active]``: active rows whose next ``1 + k`` tokens start a new block
    (0.19's ``_get_async_sched_rows_requiring_new_block``)."""
    last = table.rows[FIELD_LAST_OFFSET, table.paused:table.total]
    return last.astype(np.int64) + table.decode_query >= table.block_size


def _check_decode_only(table) -> None:
    if table.num_prefill != 0:
        raise RuntimeError("Async scheduling only supports decode-only steps "
                           f"(num_prefill_requests={table.num_prefill}).")
    if table.paused != 0:
        raise RuntimeError("Async scheduling does not support paused requests "
                           f"(paused_request_count={table.paused}).")


class PreparePlan(NamedTuple):
    """What ``prepare_requests`` changes: ``rows`` (active rows, all decode, no paused row
    before them) needing a block, the block-table ``columns`` each appends at, and the rows'
    fields afterwards (``fields``, int32 ``[NUM_FIELDS, active]`` without the new blocks)."""

    rows: np.ndarray
    columns: np.ndarray
    fields: np.ndarray


def plan_prepare(table) -> PreparePlan:
    """Check ``prepare_requests`` against ``table`` and plan it; changes nothing. The block
    count itself is taken by the caller (0.19 asks the allocator)."""
    _check_decode_only(table)
    active = table.active
    need = rows_requiring_new_block(table)
    rows = np.flatnonzero(need)
    columns = table.rows[FIELD_BLOCKS, rows].astype(np.int64)
    full = np.flatnonzero(columns >= table.max_kv_block_count)
    if full.size:
        row = int(rows[full[0]])
        raise RuntimeError(f"prepare_requests(): row {row} holds max_kv_block_count="
                           f"{table.max_kv_block_count} blocks already; its next tokens lie past "
                           "max_sequence_length (finish it first)")
    fields = table.rows[:, :active].copy()
    last = fields[FIELD_LAST_OFFSET].astype(np.int64)
    fields[FIELD_KV_OFFSET] += fields[FIELD_QUERY]
    fields[FIELD_QUERY] = table.decode_query
    fields[FIELD_LAST_OFFSET] = (last + table.decode_query) % table.block_size
    return PreparePlan(rows, columns, fields)


def commit_prepare(table, plan: PreparePlan, blocks: np.ndarray) -> None:
    """Apply ``plan`` with ``blocks`` (one per ``plan.rows``, allocated) to the host rows."""
    active = plan.fields.shape[1]
    table.rows[:, :active] = plan.fields
    if plan.rows.size:
        table.block_table[plan.rows, plan.columns] = blocks
        table.rows[FIELD_BLOCKS, plan.rows] = plan.columns + 1
        table.rows[FIELD_LAST_BLOCK, plan.rows] = blocks
        table.dirty_from = min(table.dirty_from, int(plan.rows.min()))
    table.active_tokens = active * table.decode_query
    table.fed_decode = 0
    table.continuation_added = False


def prepared_token_arrays(table, old_last_offsets: np.ndarray, old_last_blocks: np.ndarray,
                          plan: PreparePlan, blocks: np.ndarray) -> dict:
    """0.19's token arrays of the prepared step (all but the input ids, which the sampled
    tokens fill): ``1 + k`` tokens a row at consecutive positions, each in the row's last
    block of before, or the new one once it crosses the block boundary. Host int64 arrays."""
    active, per_row, block_size = plan.fields.shape[1], table.decode_query, table.block_size
    offsets = np.arange(per_row)
    positions = plan.fields[FIELD_KV_OFFSET].astype(np.int64)[:, None] + offsets[None, :]
    token_blocks = np.repeat(old_last_blocks.astype(np.int64)[:, None], per_row, axis=1)
    if plan.rows.size:
        crossed = (old_last_offsets[plan.rows, None].astype(np.int64) + 1 + offsets[None, :]
                   >= block_size)
        token_blocks[plan.rows] = np.where(crossed, blocks[:, None].astype(np.int64),
                                           token_blocks[plan.rows])
    positions = positions.reshape(-1)
    return dict(token_to_pos_ids=positions, token_to_position_in_request=positions,
                token_to_request_idx=np.repeat(np.arange(active), per_row),
                token_to_block_idx=token_blocks.reshape(-1),
                token_to_local_position_within_kv_block=positions % block_size)


def read_resolve_mask(mask, total: int) -> np.ndarray:
    """``resolve_requests``' ``active_requests_mask`` as host bool ``[total]`` (0.19's
    ``RuntimeError`` for a wrong length; a value other than 0 and 1: ``ValueError``)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"active_requests_mask must be a torch.Tensor, got {type(mask)}")
    if mask.dim() != 1 or mask.numel() != total:
        got = mask.numel() if mask.dim() == 1 else f"shape {tuple(mask.shape)}"
        raise RuntimeError(f"Expected active mask of length {total}, got {got}.")
    if mask.device.type == "meta":
        raise ValueError("active_requests_mask is on meta (it holds no values to read)")
    host = mask.detach().cpu().numpy()
    ones = host == 1
    bad = ~ones & (host != 0)
    if bad.any():
        raise ValueError(f"active_requests_mask must hold only 0 and 1, got "
                         f"{host[bad][:4].tolist()}")
    return ones


def plan_resolve(table, keep: np.ndarray) -> tuple:
    """``resolve_requests``' plan: the finished rows release their blocks and slots, the
    survivors on the right fill the holes on the left (0.19's order, that of
    ``update_requests``), nothing advances. Returns ``(UpdatePlan, survivor_idxs)``
    (``survivor_idxs[r]``: the old row that row ``r`` holds); changes nothing."""
    if table.paused != 0:
        raise RuntimeError("Async scheduling does not support paused requests "
                           f"(paused_request_count={table.paused}).")
    if table.chunked_id != -1:
        raise RuntimeError(f"Async scheduling does not support the chunked prefill request "
                           f"{table.chunked_id} (its next chunk needs update_requests)")
    total = table.total
    allocator = table.allocator
    scratch = PlanScratch(table, AllocatorSimulation(allocator) if allocator.keeps_idle_blocks
                          else StackSimulation(allocator))
    fields = scratch.fields
    finished_ids = fields[FIELD_IDS, :total][~keep].astype(np.int64)
    active = int(keep.sum())
    finished = np.flatnonzero(~keep)
    if finished.size:
        scratch.release(finished)
        holes = np.flatnonzero(~keep[:active])
        movers = active + np.flatnonzero(keep[active:])
        if holes.size:
            scratch.move(holes, movers)
            scratch.clear(movers)
    slots = np.concatenate(scratch.slots) if scratch.slots else np.empty(0, dtype=np.int32)
    plan = UpdatePlan(
        old_paused=0, old_total=total, paused=0, total=active,
        active_tokens=table.active_tokens, origin=scratch.origin, rows=fields,
        append_col=scratch.append_col, append_block=scratch.append_block,
        allocator_ops=tuple(scratch.stack.ops), released_slots=slots,
        finished_ids=finished_ids, evicted_ids=_EMPTY, newly_paused_ids=_EMPTY,
        max_length_ids=_EMPTY)
    return plan, scratch.origin[:active].copy()
