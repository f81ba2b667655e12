"""The step-end state machine (``update_requests``, docs/SEMANTICS.md §9, fixed), as a plan.

``plan_update`` decides, from the unchanged ``RequestTable``, everything one update does: which
requests finish, how rows compact, which pause, resume (LIFO, one new block each) or are evicted
beyond the paused budget, and the chunked request's move to the last row. It works on a scratch
copy of the per-request fields and a simulation of the block allocator's stack, so it changes
nothing; every error it can meet (an unknown chunked id, no request able to run) raises here,
and a request kept past ``max_sequence_length`` is finished here. ``RequestTable.commit_update``
then applies the plan, and the device state applies the row plan in one launch.

``plan_decode`` is the steady decode step's shortcut: when nothing finishes, pauses for good or
is evicted, it says in a few vectorised operations what ``plan_update`` would decide, and
``RequestTable.commit_decode`` applies it; everything else takes ``plan_update``.

With prefix caching (docs/SEMANTICS.md §17.4) the budgets count physical blocks: the active
usage is the number of distinct blocks the active rows hold, the paused usage the number of
distinct blocks paused rows hold and no active row does; resume and eviction weigh each row
by the blocks only it brings (``first_holder_counts``). Without caching a row's weight is its
block count, as upstream (a block then has one holder).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from ._fields import (
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_OFFSET,
    FIELD_OUTPUT,
    FIELD_QUERY,
)
from .block_allocator import AllocatorSimulation, StackSimulation
from .plan_scratch import PlanScratch, distinct_blocks

_EMPTY = np.empty(0, dtype=np.int64)
_NO_ROWS = np.empty(0, dtype=np.int64)
#: Up to this many rows filling their last block in one decode update (candidates of its byte
#: search), plan_decode finds them and orders the swaps with Python; beyond, with numpy (tests
#: lower it to cover both).
SMALL_CROSSING = 16


@dataclass(frozen=True)
class UpdatePlan:
    """Everything one ``update_requests`` changes, decided before anything changes.

    ``origin[r]``: the old row whose data row ``r`` holds afterwards (rows ``[0, old_total)``);
    ``rows``: the per-request fields of rows ``[0, old_total)`` afterwards; ``append_col`` /
    ``append_block``: the block each resumed row appends (-1: none); ``allocator_ops``: the
    block releases and allocations, in order, that ``commit`` replays on the allocator.
    """

    old_paused: int
    old_total: int
    paused: int
    total: int
    active_tokens: int
    origin: np.ndarray
    rows: np.ndarray
    append_col: np.ndarray
    append_block: np.ndarray
    allocator_ops: Tuple[tuple, ...]
    released_slots: np.ndarray
    finished_ids: np.ndarray
    evicted_ids: np.ndarray
    newly_paused_ids: np.ndarray
    max_length_ids: np.ndarray


class DecodePlan(NamedTuple):
    """The plan of a decode update (``plan_decode``): nothing finishes, pauses for good or is
    evicted, and the rows whose last block is full start a new one at once.

    ``max_kv_offset``: the largest ``FIELD_KV_OFFSET`` afterwards (the next step's longest
    request has one more token). ``kv_offsets``: the new ``FIELD_KV_OFFSET`` of rows
    ``[0, total)``, in the current row order, or None when every row holds one token (the
    offsets advance by one); ``FIELD_QUERY`` becomes 1 and ``FIELD_LAST_OFFSET`` advances by
    one, modulo the block size. ``full``: None when no row starts a block; else those rows (a
    list, in the current order, ascending), and ``dst``/``src``: the row swaps that move them
    to the rows ``[0, len(full))`` (rows ``dst`` take rows ``src``), where each appends a block
    (the general path pauses them to the front and resumes them, LIFO, each with one new
    block).
    ``active_blocks``: the sum of the active rows' block counts afterwards, or None when the
    plan did not need it. ``per_row``: each row's tokens in the next step (``1 + k`` for a
    speculative decode plan, else 1).
    """

    max_kv_offset: int
    kv_offsets: Optional[np.ndarray]
    full: Optional[List[int]]
    dst: Optional[np.ndarray]
    src: Optional[np.ndarray]
    active_blocks: Optional[int] = None
    per_row: int = 1


def plan_decode(table, *, chunked_id: int, max_sequence_length: int,
                max_kv_offset: Optional[int] = None, active_blocks: Optional[int] = None,
                plain: bool = False) -> Optional[DecodePlan]:
    """The plan of the steady decode update of a mask that keeps every request, or None where
    ``plan_update`` must decide. ``max_kv_offset``: when the caller knows that every active row
    holds one token and the largest KV offset plus one (the step's ``max_seqlen_k``, its rows
    unchanged since), that value; else it is computed here. ``active_blocks``: the sum of the
    active rows' block counts when the caller knows it (the previous decode plan's, the rows
    unchanged since); else it is computed here when a row fills its last block.

    It applies when nothing is paused, no chunked prefill is in flight, no request reaches
    ``max_sequence_length``, and the requests whose last block is full can all resume at once
    (free blocks and the active budget allow one more block each). Then ``plan_update`` would
    pause those requests to the front rows and resume them in the same update, each with one
    new block, and change nothing else: this plan says the same with a few vectorised
    operations over the rows (``tests/context/test_decode_path.py`` checks the two paths equal,
    state after state). Changes nothing.

    Speculative steps (``k > 0``) whose every row forwards ``k`` drafts next take
    ``_plan_speculative_decode`` (their rows take blocks early); ``plain`` ones (one token a row
    in the step and in the next, no drafts either side) this plan, while the rows fit the
    ``max_tokens // (1 + k)`` that ``plan_update`` pauses beyond.
    """
    total = table.total
    if table.paused or chunked_id != -1 or not total:
        return None
    rows = table.rows
    if table.speculative and not plain:
        return _plan_speculative_decode(table, max_sequence_length, active_blocks)
    if table.speculative and total > table.max_tokens // table.decode_query:
        return None   # plan_update pauses the rows beyond
    # A request whose next token would lie at max_sequence_length or beyond is finished, which
    # plan_update decides.
    if max_kv_offset is not None:
        kv_offsets = None
    elif rows[FIELD_QUERY, :total].tobytes() == table.one_bytes[:4 * total]:
        # Every row holds one token (the steady step): the offsets advance by one.
        kv_offsets = None
        max_kv_offset = int(np.maximum.reduce(rows[FIELD_KV_OFFSET, :total])) + 1
    else:
        kv_offsets = rows[FIELD_KV_OFFSET, :total] + rows[FIELD_QUERY, :total]
        max_kv_offset = int(np.maximum.reduce(kv_offsets))
    if max_kv_offset >= max_sequence_length:
        return None
    # Which requests fill their last block: the int32 block_size - 1 in the last-block
    # offsets' bytes, found by its first byte (memchr); None from the search past
    # SMALL_CROSSING candidates, where numpy finds them.
    offset_bytes = rows[FIELD_LAST_OFFSET, :total].tobytes()
    full = _aligned_matches(offset_bytes, table.full_block_bytes, SMALL_CROSSING)
    if full is None:
        full = (rows[FIELD_LAST_OFFSET, :total] == table.block_size - 1).nonzero()[0].tolist()
    return _decode_moves(table, max_kv_offset, kv_offsets, full, active_blocks)


def _plan_speculative_decode(table, max_sequence_length: int,
                             active_blocks: Optional[int]) -> Optional[DecodePlan]:
    """``plan_decode`` with ``num_speculative_tokens = k > 0`` (docs/SEMANTICS.md §19): every
    row advances by its query (its ``1 + k`` tokens, fewer after a rewind lowered its offset),
    and the rows whose next ``1 + k`` tokens cross into a new block (last offset ``>= block_size
    - 1 - k``) take it now, as ``plan_update``'s pause and resume would; None past
    ``max_tokens // (1 + k)`` rows (they pause) or ``max_sequence_length``."""
    total, rows = table.total, table.rows
    if total > table.max_tokens // table.decode_query:
        return None
    kv_offsets = rows[FIELD_KV_OFFSET, :total] + rows[FIELD_QUERY, :total]
    max_kv_offset = int(np.maximum.reduce(kv_offsets))
    if max_kv_offset >= max_sequence_length:
        return None
    threshold = table.block_size - 1 - table.speculative
    full = np.flatnonzero(rows[FIELD_LAST_OFFSET, :total] >= threshold).tolist()
    plan = _decode_moves(table, max_kv_offset, kv_offsets, full, active_blocks)
    return None if plan is None else plan._replace(per_row=table.decode_query)


def _decode_moves(table, max_kv_offset: int, kv_offsets: Optional[np.ndarray], full: List[int],
                  active_blocks: Optional[int]) -> Optional[DecodePlan]:
    """The decode plan of rows ``full`` (ascending) that start a block: the swaps that move
    them to the front rows, or None where ``plan_update`` must decide (a block count outside
    the table, too few free blocks or too small an active budget)."""
    rows, total = table.rows, table.total
    filled = len(full)
    if not filled:
        return DecodePlan(max_kv_offset, kv_offsets, None, None, None, active_blocks)
    # A block count outside the block table (written by hand) has no column for the new block:
    # plan_update raises for it.
    counts, width = rows[FIELD_BLOCKS], table.max_kv_block_count
    if filled <= SMALL_CROSSING:
        count = counts.item
        for row in full:
            if not 0 <= count(row) < width:
                return None
    elif not 0 <= counts[full].min() <= counts[full].max() < width:
        return None
    if active_blocks is None:
        active_blocks = int(np.add.reduce(rows[FIELD_BLOCKS, :total]))
    allocator = table.allocator
    if filled > allocator.total_avail or active_blocks + filled > allocator.active_count:
        return None
    # plan_update's pause: the full rows among the first ``filled`` stay, the others
    # (left_keep) swap, in order, with the full rows past them (right_full).
    front = bisect.bisect_left(full, filled)
    if front == filled:
        return DecodePlan(max_kv_offset, kv_offsets, full, _NO_ROWS, _NO_ROWS,
                          active_blocks + filled)
    right_full = full[front:]
    if filled <= SMALL_CROSSING:
        # A few rows (the common case): Python lists beat a dozen numpy calls.
        stay = set(full[:front])
        left_keep = [row for row in range(filled) if row not in stay]
    else:
        keep = np.ones(filled, dtype=np.bool_)
        keep[full[:front]] = False
        left_keep = keep.nonzero()[0].tolist()
    # One array: dst (left_keep, then right_full) and src (right_full, then left_keep).
    moved = len(left_keep) + len(right_full)
    swaps = np.array(left_keep + right_full + right_full + left_keep)
    return DecodePlan(max_kv_offset, kv_offsets, full, swaps[:moved], swaps[moved:],
                      active_blocks + filled)


def _aligned_matches(data: bytes, pattern: bytes, limit: int) -> Optional[List[int]]:
    """The indices, ascending, of the int32 values of ``data`` equal to the int32 ``pattern``,
    or None once more than ``limit`` bytes of ``data`` equal the pattern's first."""
    found = []
    first = pattern[:1]
    i = data.find(first)
    candidates = 0
    while i >= 0:
        candidates += 1
        if candidates > limit:
            return None
        if not i & 3 and data[i:i + 4] == pattern:
            found.append(i >> 2)
        i = data.find(first, i + 1)
    return found


def plan_update(table, mask: np.ndarray, *, chunked_id: int, max_sequence_length: int,
                draft_counts: Optional[np.ndarray] = None) -> UpdatePlan:
    """The plan of one ``update_requests`` (see the module docstring); changes nothing.

    ``mask``: host bool ``[active]`` (True keeps the request), already checked for shape.
    ``draft_counts``: speculative steps, host int ``[active]`` in ``[0, k]`` (checked): the
    drafts each row forwards next (its query length ``1 + count``); a row resumed from the
    paused ones forwards none; None: every row forwards ``k`` (docs/SEMANTICS.md §19).
    """
    paused, total = table.paused, table.total
    active_before = total - paused
    old_paused, old_total = paused, total
    ids = table.rows[FIELD_IDS]
    if chunked_id != -1:
        last = int(ids[total - 1]) if active_before else None
        if last != chunked_id:
            raise ValueError(
                f"chunked_prefill_request_id={chunked_id} is not the chunked prefill in the "
                f"context: the last active row holds request {last} (a chunked prefill is "
                "always the last active row after its chunk is added); set it to -1 or to the "
                "id of the request whose prompt was added in part")
        mask = mask.copy()
        mask[-1] = True
    # A kept request gets one more token: a request whose next token would lie beyond
    # max_sequence_length (its block-table row holds no more) is finished here, before anything
    # changes, and reported in ``max_length_ids`` (docs/SEMANTICS.md §9).
    max_length_ids = _EMPTY
    lengths = (table.rows[FIELD_KV_OFFSET, paused:total].astype(np.int64)
               + table.rows[FIELD_QUERY, paused:total] + 1)
    if lengths.size and lengths.max() > max_sequence_length and \
            (too_long := mask & (lengths > max_sequence_length)).any():
        max_length_ids = ids[paused:total][too_long].astype(np.int64)
        mask = mask & ~too_long

    allocator = table.allocator
    scratch = PlanScratch(table, AllocatorSimulation(allocator) if allocator.keeps_idle_blocks
                       else StackSimulation(allocator))
    fields = scratch.fields
    if draft_counts is not None:
        # Each old row's drafts in the next step: the given ones, none for a paused row.
        scratch.next_drafts = np.zeros(total, dtype=np.int64)
        scratch.next_drafts[paused:total] = draft_counts
    active = int(mask.sum())
    finished_ids = fields[FIELD_IDS, paused:total][~mask].astype(np.int64)
    paused_now = _EMPTY
    evicted = _EMPTY
    if active + paused == 0:
        scratch.release(np.arange(paused, total))
        paused = total = 0
    else:
        finished_rows = paused + np.flatnonzero(~mask)
        if finished_rows.size:
            scratch.release(finished_rows)
            if active > 0:
                holes = paused + np.flatnonzero(~mask[:active])
                movers = paused + active + np.flatnonzero(mask[active:])
                if holes.size:
                    scratch.move(holes, movers)
                    scratch.clear(movers)
        total = paused + active
        if active > 0:
            if table.speculative:
                # A step's 1 + k tokens must fit: the block is taken early (0.19), and rows
                # past max_tokens // (1 + k) pause (without a chunked prefill, as 0.19).
                need = (fields[FIELD_LAST_OFFSET, paused:total]
                        + scratch.next_query(np.arange(paused, total)) >= table.block_size)
                if chunked_id == -1:
                    need[table.max_tokens // table.decode_query:] = True
            else:
                need = fields[FIELD_LAST_OFFSET, paused:total] == table.block_size - 1
            if chunked_id != -1:
                need &= fields[FIELD_IDS, paused:total] != chunked_id
            filled = int(need.sum())
            if filled:
                paused_now = fields[FIELD_IDS, paused:total][need].astype(np.int64)
                if filled < active:
                    left_keep = np.flatnonzero(~need[:filled])
                    right_need = filled + np.flatnonzero(need[filled:])
                    scratch.move(paused + np.concatenate([left_keep, right_need]),
                                 paused + np.concatenate([right_need, left_keep]))
                paused, active = paused + filled, active - filled
        paused, active = scratch.resume(paused, active, allocator.active_count)
        paused, evicted = scratch.evict(paused, active, allocator.paused_count)
        paused, active = scratch.resume(paused, active, allocator.active_count)
        total = paused + active
        if active == 0:
            raise RuntimeError(_none_can_run(table, scratch, paused, max_sequence_length))
        if chunked_id != -1:
            row = paused + int(np.flatnonzero(fields[FIELD_IDS, paused:total] == chunked_id)[0])
            if row != total - 1:
                scratch.move(np.array([row, total - 1]), np.array([total - 1, row]))
        # The next step is a pure decode unless requests are added: 1 + k tokens a row (the
        # chunked request keeps one placeholder token until its next chunk).
        # 1 + k tokens a row, or 1 + its own drafts (none for a row resumed from the paused).
        per_row = table.decode_query if draft_counts is None else \
            scratch.next_query(np.arange(paused, total))
        fields[FIELD_KV_OFFSET, paused:total] += fields[FIELD_QUERY, paused:total]
        fields[FIELD_QUERY, paused:total] = per_row
        fields[FIELD_LAST_OFFSET, paused:total] = \
            (fields[FIELD_LAST_OFFSET, paused:total] + per_row) % table.block_size
        if table.speculative and chunked_id != -1:
            fields[FIELD_QUERY, total - 1] = 1
    newly_paused = _EMPTY
    if paused and paused_now.size:
        still_paused = fields[FIELD_IDS, :paused].astype(np.int64)
        newly_paused = still_paused[np.isin(still_paused, paused_now)]
    slots = np.concatenate(scratch.slots) if scratch.slots else np.empty(0, dtype=np.int32)
    return UpdatePlan(
        old_paused=old_paused, old_total=old_total, paused=paused, total=total,
        active_tokens=int(fields[FIELD_QUERY, paused:total].sum()) if table.speculative
        else total - paused,
        origin=scratch.origin, rows=fields, append_col=scratch.append_col,
        append_block=scratch.append_block, allocator_ops=tuple(scratch.stack.ops),
        released_slots=slots, finished_ids=finished_ids, evicted_ids=evicted,
        newly_paused_ids=newly_paused, max_length_ids=max_length_ids)


def _none_can_run(table, scratch: PlanScratch, paused: int, max_sequence_length: int) -> str:
    """Why no request of ``plan_update`` can run, and which argument gives the active budget
    what the first request a resume found unable to run (the last paused row, LIFO) needs to
    run on and to finish (its output length, at most ``max_sequence_length``)."""
    fields, allocator = scratch.fields, table.allocator
    paused_blocks = (distinct_blocks(scratch.held(np.arange(paused))).size if scratch.distinct
                     else int(fields[FIELD_BLOCKS, :paused].sum()))
    text = (f"no request can run: {paused} paused requests hold {paused_blocks} blocks and none "
            f"can resume ({scratch.stack.total_avail} free blocks, active budget "
            f"{allocator.active_count})")
    if scratch.blocked is not None:
        row, need = scratch.blocked
        tokens = min(int(row[FIELD_OUTPUT]), max_sequence_length)
        finish = max(need, -(-tokens // table.block_size))
        text += (f": request {int(row[FIELD_IDS])} needs {need} blocks of the active budget to "
                 f"run on (its {need - 1} and a new one), {finish} to reach its {tokens} tokens")
        if finish > allocator.active_count and table.budget_advice is not None:
            text += ": " + table.budget_advice(finish - allocator.active_count)
    return text + "; nothing was changed"
