"""The update plan's working copy (``update_plan``): the per-request fields of a
``RequestTable`` copied for one plan, with the blocks its rows hold and the allocator's stack
simulated, so that a plan finishes, compacts, resumes and evicts rows without changing anything.

``held_blocks``, ``distinct_blocks`` and ``first_holder_counts`` are the budgets' counts under
prefix caching (docs/SEMANTICS.md §17.4): the distinct blocks a set of rows holds, and per row
the blocks only it brings.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ._fields import (
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
)
from .block_allocator import StackSimulation

_EMPTY = np.empty(0, dtype=np.int64)
_NO_ROWS = np.empty(0, dtype=np.int64)


def held_blocks(block_table: np.ndarray, counts: np.ndarray, dummy: int) -> np.ndarray:
    """The blocks ``block_table`` rows hold, as ``[rows, max(counts)]`` with -1 beyond each
    row's ``counts`` and for the dummy block (which no request owns)."""
    width = int(counts.max()) if counts.size else 0
    held = block_table[:, :width].astype(np.int64)
    held[(np.arange(width)[None, :] >= counts[:, None]) | (held == dummy)] = -1
    return held


def distinct_blocks(held: np.ndarray) -> np.ndarray:
    """The distinct block ids of ``held`` (``held_blocks``'s form), sorted. A mark per block id
    (linear in the entries; ``np.unique`` sorts, about 15x slower at 256 rows of 128 blocks)."""
    flat = held.reshape(-1)
    ids = flat[flat >= 0]
    if not ids.size:
        return ids
    mark = np.zeros(int(ids.max()) + 1, dtype=np.bool_)
    mark[ids] = True
    return np.flatnonzero(mark)


def first_holder_counts(held: np.ndarray, exclude: np.ndarray) -> np.ndarray:
    """Per row of ``held`` (``held_blocks``'s form), the blocks not in ``exclude`` and held by
    no earlier row: their running sum over the rows is the number of distinct
    blocks the rows hold beyond ``exclude``. Linear in the entries: each block's first entry
    (``np.minimum.at``, row-major order), then a count per row of the first entries."""
    rows, width = held.shape
    flat = held.reshape(-1)
    index = np.flatnonzero(flat >= 0)
    if not index.size:
        return np.zeros(rows, dtype=np.int64)
    ids = flat[index]
    none = flat.size
    first = np.full(int(ids.max()) + 1, none, dtype=np.int64)
    np.minimum.at(first, ids, index)
    if exclude.size:
        first[exclude[exclude < first.size]] = none
    return np.bincount(first[first < none] // max(width, 1), minlength=rows).astype(np.int64)


class PlanScratch:
    """Scratch rows: the fields of rows ``[0, total)``, each row's origin and appended block."""

    def __init__(self, table, allocator_sim: StackSimulation):
        total = table.total
        self.table = table
        self.fields = table.rows[:, :total].copy()
        self.origin = np.arange(total, dtype=np.int64)
        self.append_col = np.full(total, -1, dtype=np.int32)
        self.append_block = np.full(total, -1, dtype=np.int32)
        self.stack = allocator_sim
        self.slots: List[np.ndarray] = []
        # ``(row fields, blocks)`` of the first paused row a resume found unable to run.
        self.blocked: Optional[Tuple[np.ndarray, int]] = None
        # Prefix caching: the budgets count distinct blocks (docs/SEMANTICS.md §17.4).
        self.distinct = table.prefix_cache is not None
        # Speculative steps: the drafts each row (by its origin) forwards in the next step;
        # None: k each (update_plan.plan_update sets it from update_requests' draft_counts).
        self.next_drafts: Optional[np.ndarray] = None

    def next_query(self, rows: np.ndarray) -> np.ndarray:
        """Speculative steps: the next step's tokens of scratch rows ``rows`` (``1 +`` their
        drafts)."""
        if self.next_drafts is None:
            return np.full(rows.size, self.table.decode_query, dtype=np.int64)
        return 1 + self.next_drafts[self.origin[rows]]

    def held(self, rows: np.ndarray) -> np.ndarray:
        """``held_blocks`` of the scratch rows ``rows``, their appended blocks included."""
        held = held_blocks(self.table.block_table[self.origin[rows]],
                           self.fields[FIELD_BLOCKS, rows], self.table.allocator.dummy_block_idx)
        columns = self.append_col[rows]
        appended = np.flatnonzero(columns >= 0)
        if appended.size:
            held[appended, columns[appended]] = self.append_block[rows[appended]]
        return held

    def active_blocks(self, paused: int, active: int) -> np.ndarray:
        """The distinct blocks the active rows ``[paused, paused + active)`` hold (prefix
        caching)."""
        return distinct_blocks(self.held(np.arange(paused, paused + active)))

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        for array in (self.origin, self.append_col, self.append_block):
            array[dst] = array[src]
        self.fields[:, dst] = self.fields[:, src]

    def clear(self, rows: np.ndarray) -> None:
        self.fields[FIELD_IDS, rows] = -1
        self.fields[FIELD_MAMBA_SLOT, rows] = -1
        self.append_col[rows] = -1
        self.append_block[rows] = -1

    def release(self, rows: np.ndarray) -> None:
        """Release the blocks (row-major, as the reference pushes them) and slots of ``rows``."""
        if rows.size:
            table = self.table.block_table[self.origin[rows]]
            table = np.concatenate([table, self.append_block[rows, None]], axis=1)
            self.stack.release(table.reshape(-1))
            if self.table.hybrid:
                self.slots.append(self.fields[FIELD_MAMBA_SLOT, rows].copy())
        self.clear(rows)

    def resume(self, paused: int, active: int, active_budget: int) -> Tuple[int, int]:
        """Resume paused requests, right-most first (LIFO), each with one new block (with
        speculative steps, those whose last offset reached ``block_size - 1 - k``; at most
        ``max_tokens // (1 + k)`` rows active, as 0.19)."""
        if paused == 0:
            return paused, active
        table = self.table
        if table.speculative:
            return self._resume_speculative(paused, active, active_budget)
        counts = self.fields[FIELD_BLOCKS]
        if self.distinct:
            # Each paused row (LIFO order) needs the blocks no active row and no row resumed
            # before it holds, plus its new block.
            held_active = self.active_blocks(paused, active)
            avail_active = active_budget - held_active.size
            needs = first_holder_counts(self.held(np.arange(paused - 1, -1, -1)), held_active) + 1
        else:
            avail_active = active_budget - int(counts[paused:paused + active].sum())
            needs = counts[:paused][::-1].astype(np.int64) + 1
        resumed = int(np.count_nonzero(np.cumsum(needs) <= avail_active))
        resumed = min(resumed, self.stack.total_avail)
        if resumed == 0:
            if self.blocked is None:
                self.blocked = (self.fields[:, paused - 1].copy(), int(needs[0]))
            return paused, active
        rows = np.arange(paused - resumed, paused)
        self._check_columns(rows, counts[rows])
        blocks = self.stack.allocate(resumed)
        self.append_col[rows] = counts[rows]
        self.append_block[rows] = blocks
        counts[rows] += 1
        self.fields[FIELD_LAST_BLOCK, rows] = blocks
        return paused - resumed, active + resumed

    def _resume_speculative(self, paused: int, active: int, active_budget: int
                            ) -> Tuple[int, int]:
        """``resume`` with ``num_speculative_tokens = k > 0`` (0.19's ``resume_paused_requests``):
        a row needs a block only when its next step's tokens cross into one (its last offset
        reached ``block_size - 1 - k``, or ``- drafts`` with its own count)."""
        table, counts = self.table, self.fields[FIELD_BLOCKS]
        order = np.arange(paused - 1, -1, -1)
        needs_block = (self.fields[FIELD_LAST_OFFSET, order] + self.next_query(order)
                       >= table.block_size).astype(np.int64)
        if self.distinct:
            held_active = self.active_blocks(paused, active)
            avail_active = active_budget - held_active.size
            needs = first_holder_counts(self.held(order), held_active) + needs_block
        else:
            avail_active = active_budget - int(counts[paused:paused + active].sum())
            needs = counts[order].astype(np.int64) + needs_block
        resumed = int(np.count_nonzero(np.cumsum(needs) <= avail_active))
        resumed = min(resumed, self.stack.total_avail,
                      max(0, table.max_tokens // table.decode_query - active))
        if resumed == 0:
            if self.blocked is None:
                self.blocked = (self.fields[:, paused - 1].copy(), int(needs[0]))
            return paused, active
        rows = np.arange(paused - resumed, paused)
        growing = rows[needs_block[:resumed][::-1] > 0]
        if growing.size:
            self._check_columns(growing, counts[growing])
            blocks = self.stack.allocate(growing.size)
            self.append_col[growing] = counts[growing]
            self.append_block[growing] = blocks
            counts[growing] += 1
            self.fields[FIELD_LAST_BLOCK, growing] = blocks
        return paused - resumed, active + resumed

    def _check_columns(self, rows: np.ndarray, columns: np.ndarray) -> None:
        """Each of ``rows`` appends its next block at its block count: a count outside the
        block table (written by hand; the API never makes one, a request finishes at
        ``max_sequence_length`` first) raises here, before anything changes."""
        width = self.table.max_kv_block_count
        bad = np.flatnonzero((columns < 0) | (columns >= width))
        if bad.size:
            row = int(rows[bad[0]])
            raise IndexError(
                f"request {int(self.fields[FIELD_IDS, row])} (row {int(self.origin[row])}) needs a "
                f"new block at column request_kv_block_counts={int(columns[bad[0]])}, outside the "
                f"block table's [0, max_kv_block_count={width}) (a count written by hand?); "
                "nothing was changed")

    def evict(self, paused: int, active: int, paused_budget: int) -> Tuple[int, np.ndarray]:
        """Evict paused requests from the right until paused blocks fit their budget."""
        if paused == 0:
            return paused, _EMPTY
        if self.distinct:
            # A paused row weighs the blocks no active row and no paused row left of it holds:
            # the running sum is the paused usage of the rows so far, and the sum of the
            # right-most rows' weights is what evicting them frees.
            counts = first_holder_counts(self.held(np.arange(paused)),
                                         self.active_blocks(paused, active))
        else:
            counts = self.fields[FIELD_BLOCKS, :paused].astype(np.int64)
        if counts.sum() <= paused_budget:
            return paused, _EMPTY
        overflow = paused - int(np.count_nonzero(np.cumsum(counts) <= paused_budget))
        if overflow == 0:
            return paused, _EMPTY
        tail = counts[paused - overflow:][::-1]
        net = np.cumsum(tail) - (overflow - 1 - np.arange(overflow))
        evict = int(np.flatnonzero(net >= 0)[0]) + 1
        rows = np.arange(paused - evict, paused)
        evicted = self.fields[FIELD_IDS, rows].astype(np.int64)
        self.release(rows)
        total = paused + active
        if evict < active:
            left, right = rows, np.arange(total - evict, total)
        else:
            left = np.arange(paused - evict, paused - evict + active)
            right = np.arange(paused, paused + active)
        self.move(np.concatenate([left, right]), np.concatenate([right, left]))
        self.clear(np.arange(total - evict, total))
        return paused - evict, evicted
