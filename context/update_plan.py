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
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_QUERY,
)
from .block_allocator import AllocatorSimulation

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


class _StackSim:
    """The allocator's LIFO stack as it would be after this plan's releases and allocations,
    without touching it: the untouched bottom ``bag[:avail]`` plus an overlay of pushed ids."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.base_avail = allocator.total_avail
        self.overlay = np.empty(0, dtype=np.int32)
        self.released = np.empty(0, dtype=np.int32)
        self.ops: List[tuple] = []

    @property
    def total_avail(self) -> int:
        return self.base_avail + self.overlay.size

    def release(self, blocks: np.ndarray) -> None:
        """As ``BlockAllocator.release_memory_blocks``: drop one reference per id; the ids
        whose last reference goes are pushed once, in order of first mention."""
        # The dummy block (rows of dummy requests) is never allocated: nothing to release.
        blocks = blocks[(blocks >= 0) & (blocks != self.allocator.dummy_block_idx)].astype(np.int32)
        if blocks.size == 0:
            return
        self.ops.append(("release", blocks))
        left = self.allocator.ref_counts[blocks].astype(np.int64)
        if self.released.size:
            done = np.sort(self.released)
            left -= (np.searchsorted(done, blocks, "right") - np.searchsorted(done, blocks, "left"))
        self.released = np.concatenate([self.released, blocks])
        _, inverse, counts = np.unique(blocks, return_inverse=True, return_counts=True)
        freed = blocks[left - counts[inverse] == 0]
        if freed.size > 1:
            _, first = np.unique(freed, return_index=True)
            freed = freed[np.sort(first)]
        self.overlay = np.concatenate([self.overlay, freed])

    def allocate(self, count: int) -> np.ndarray:
        self.ops.append(("allocate", count))
        if count <= self.overlay.size:
            blocks = self.overlay[self.overlay.size - count:]
            self.overlay = self.overlay[:self.overlay.size - count]
            return blocks
        below = count - self.overlay.size
        bag = self.allocator.block_bag
        blocks = np.concatenate([bag[self.base_avail - below:self.base_avail], self.overlay])
        self.base_avail -= below
        self.overlay = np.empty(0, dtype=np.int32)
        return blocks


class _Scratch:
    """Scratch rows: the fields of rows ``[0, T)``, each row's origin and appended block."""

    def __init__(self, table, allocator_sim: _StackSim):
        T = table.total
        self.table = table
        self.h = table.rows[:, :T].copy()
        self.origin = np.arange(T, dtype=np.int64)
        self.append_col = np.full(T, -1, dtype=np.int32)
        self.append_block = np.full(T, -1, dtype=np.int32)
        self.stack = allocator_sim
        self.slots: List[np.ndarray] = []
        # Prefix caching: the budgets count distinct blocks (docs/SEMANTICS.md §17.4).
        self.distinct = table.prefix_cache is not None

    def held(self, rows: np.ndarray) -> np.ndarray:
        """``held_blocks`` of the scratch rows ``rows``, their appended blocks included."""
        held = held_blocks(self.table.block_table[self.origin[rows]], self.h[FIELD_BLOCKS, rows],
                           self.table.allocator.dummy_block_idx)
        columns = self.append_col[rows]
        appended = np.flatnonzero(columns >= 0)
        if appended.size:
            held[appended, columns[appended]] = self.append_block[rows[appended]]
        return held

    def active_blocks(self, P: int, a: int) -> np.ndarray:
        """The distinct blocks the active rows ``[P, P + a)`` hold (prefix caching)."""
        return distinct_blocks(self.held(np.arange(P, P + a)))

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        for array in (self.origin, self.append_col, self.append_block):
            array[dst] = array[src]
        self.h[:, dst] = self.h[:, src]

    def clear(self, rows: np.ndarray) -> None:
        self.h[FIELD_IDS, rows] = -1
        self.h[FIELD_MAMBA_SLOT, rows] = -1
        self.append_col[rows] = -1
        self.append_block[rows] = -1

    def release(self, rows: np.ndarray) -> None:
        """Release the blocks (row-major, as the reference pushes them) and slots of ``rows``."""
        if rows.size:
            table = self.table.block_table[self.origin[rows]]
            table = np.concatenate([table, self.append_block[rows, None]], axis=1)
            self.stack.release(table.reshape(-1))
            if self.table.hybrid:
                self.slots.append(self.h[FIELD_MAMBA_SLOT, rows].copy())
        self.clear(rows)

    def resume(self, P: int, a: int, active_budget: int) -> Tuple[int, int]:
        """Resume paused requests, right-most first (LIFO), each with one new block."""
        if P == 0:
            return P, a
        counts = self.h[FIELD_BLOCKS]
        if self.distinct:
            # Each paused row (LIFO order) needs the blocks no active row and no row resumed
            # before it holds, plus its new block.
            active = self.active_blocks(P, a)
            avail_active = active_budget - active.size
            needs = first_holder_counts(self.held(np.arange(P - 1, -1, -1)), active) + 1
        else:
            avail_active = active_budget - int(counts[P:P + a].sum())
            needs = counts[:P][::-1].astype(np.int64) + 1
        r = int(np.count_nonzero(np.cumsum(needs) <= avail_active))
        r = min(r, self.stack.total_avail)
        if r == 0:
            return P, a
        rows = np.arange(P - r, P)
        self._check_columns(rows, counts[rows])
        blocks = self.stack.allocate(r)
        self.append_col[rows] = counts[rows]
        self.append_block[rows] = blocks
        counts[rows] += 1
        self.h[FIELD_LAST_BLOCK, rows] = blocks
        return P - r, a + r

    def _check_columns(self, rows: np.ndarray, columns: np.ndarray) -> None:
        """Each of ``rows`` appends its next block at its block count: a count outside the
        block table (written by hand; the API never makes one, a request finishes at
        ``max_sequence_length`` first) raises here, before anything changes."""
        width = self.table.max_kv_block_count
        bad = np.flatnonzero((columns < 0) | (columns >= width))
        if bad.size:
            row = int(rows[bad[0]])
            raise IndexError(
                f"request {int(self.h[FIELD_IDS, row])} (row {int(self.origin[row])}) needs a new "
                f"block at column request_kv_block_counts={int(columns[bad[0]])}, outside the "
                f"block table's [0, max_kv_block_count={width}) (a count written by hand?); "
                "nothing was changed")

    def evict(self, P: int, a: int, paused_budget: int) -> Tuple[int, np.ndarray]:
        """Evict paused requests from the right until paused blocks fit their budget."""
        if P == 0:
            return P, _EMPTY
        if self.distinct:
            # A paused row weighs the blocks no active row and no paused row left of it holds:
            # the running sum is the paused usage of the rows so far, and the sum of the
            # right-most rows' weights is what evicting them frees.
            counts = first_holder_counts(self.held(np.arange(P)), self.active_blocks(P, a))
        else:
            counts = self.h[FIELD_BLOCKS, :P].astype(np.int64)
        if counts.sum() <= paused_budget:
            return P, _EMPTY
        overflow = P - int(np.count_nonzero(np.cumsum(counts) <= paused_budget))
        if overflow == 0:
            return P, _EMPTY
        tail = counts[P - overflow:][::-1]
        net = np.cumsum(tail) - (overflow - 1 - np.arange(overflow))
        evict = int(np.flatnonzero(net >= 0)[0]) + 1
        rows = np.arange(P - evict, P)
        evicted = self.h[FIELD_IDS, rows].astype(np.int64)
        self.release(rows)
        T = P + a
        if evict < a:
            left, right = rows, np.arange(T - evict, T)
        else:
            left, right = np.arange(P - evict, P - evict + a), np.arange(P, P + a)
        self.move(np.concatenate([left, right]), np.concatenate([right, left]))
        self.clear(np.arange(T - evict, T))
        return P - evict, evicted


class DecodePlan(NamedTuple):
    """The plan of a decode update (``plan_decode``): nothing finishes, pauses for good or is
    evicted, and the rows whose last block is full start a new one at once.

    ``max_kv_offset``: the largest ``FIELD_KV_OFFSET`` afterwards (the next step's longest
    request has one more token). ``kv_offsets``: the new ``FIELD_KV_OFFSET`` of rows
    ``[0, total)``, in the current row order, or None when every row holds one token (the
    offsets advance by one); ``FIELD_QUERY`` becomes 1 and ``FIELD_LAST_OFFSET`` advances by
    one, modulo the block size. ``full``: None when no row starts a block; else those rows (a
    list, in the current order, ascending), and ``dst``/``src``: the row swaps that move them
    to the rows ``[0, k)`` (rows ``dst`` take rows ``src``), where each appends one new block
    (the general path pauses them to the front and resumes them, LIFO, each with one new
    block).
    ``active_blocks``: the sum of the active rows' block counts afterwards, or None when the
    plan did not need it.
    """

    max_kv_offset: int
    kv_offsets: Optional[np.ndarray]
    full: Optional[List[int]]
    dst: Optional[np.ndarray]
    src: Optional[np.ndarray]
    active_blocks: Optional[int] = None


def plan_decode(table, *, chunked_id: int, max_sequence_length: int,
                max_kv_offset: Optional[int] = None,
                active_blocks: Optional[int] = None) -> Optional[DecodePlan]:
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
    """
    T = table.total
    if table.paused or chunked_id != -1 or not T:
        return None
    rows = table.rows
    # A request whose next token would lie at max_sequence_length or beyond is finished, which
    # plan_update decides.
    if max_kv_offset is not None:
        kv_offsets = None
    elif rows[FIELD_QUERY, :T].tobytes() == table.one_bytes[:4 * T]:
        # Every row holds one token (the steady step): the offsets advance by one.
        kv_offsets = None
        max_kv_offset = int(np.maximum.reduce(rows[FIELD_KV_OFFSET, :T])) + 1
    else:
        kv_offsets = rows[FIELD_KV_OFFSET, :T] + rows[FIELD_QUERY, :T]
        max_kv_offset = int(np.maximum.reduce(kv_offsets))
    if max_kv_offset >= max_sequence_length:
        return None
    # Which requests fill their last block: the int32 block_size - 1 in the last-block
    # offsets' bytes, found by its first byte (memchr); None from the search past
    # SMALL_CROSSING candidates, where numpy finds them.
    offset_bytes = rows[FIELD_LAST_OFFSET, :T].tobytes()
    full = _aligned_matches(offset_bytes, table.full_block_bytes, SMALL_CROSSING)
    if full is None:
        full = (rows[FIELD_LAST_OFFSET, :T] == table.block_size - 1).nonzero()[0].tolist()
    k = len(full)
    if not k:
        return DecodePlan(max_kv_offset, kv_offsets, None, None, None, active_blocks)
    # A block count outside the block table (written by hand) has no column for the new block:
    # plan_update raises for it.
    counts, width = rows[FIELD_BLOCKS], table.max_kv_block_count
    if k <= SMALL_CROSSING:
        count = counts.item
        for row in full:
            if not 0 <= count(row) < width:
                return None
    elif not 0 <= counts[full].min() <= counts[full].max() < width:
        return None
    if active_blocks is None:
        active_blocks = int(np.add.reduce(rows[FIELD_BLOCKS, :T]))
    allocator = table.allocator
    if k > allocator.total_avail or active_blocks + k > allocator.active_count:
        return None
    # plan_update's pause: the full rows among the first k stay, the others (left_keep) swap,
    # in order, with the full rows past k (right_full).
    front = bisect.bisect_left(full, k)
    if front == k:
        return DecodePlan(max_kv_offset, kv_offsets, full, _NO_ROWS, _NO_ROWS, active_blocks + k)
    right_full = full[front:]
    if k <= SMALL_CROSSING:
        # A few rows (the common case): Python lists beat a dozen numpy calls.
        stay = set(full[:front])
        left_keep = [row for row in range(k) if row not in stay]
    else:
        keep = np.ones(k, dtype=np.bool_)
        keep[full[:front]] = False
        left_keep = keep.nonzero()[0].tolist()
    # One array: dst (left_keep, then right_full) and src (right_full, then left_keep).
    moved = len(left_keep) + len(right_full)
    swaps = np.array(left_keep + right_full + right_full + left_keep)
    return DecodePlan(max_kv_offset, kv_offsets, full, swaps[:moved], swaps[moved:],
                      active_blocks + k)


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


def plan_update(table, mask: np.ndarray, *, chunked_id: int, max_sequence_length: int
                ) -> UpdatePlan:
    """The plan of one ``update_requests`` (see the module docstring); changes nothing.

    ``mask``: host bool ``[active]`` (True keeps the request), already checked for shape.
    """
    P, T = table.paused, table.total
    A = T - P
    old_P, old_T = P, T
    ids = table.rows[FIELD_IDS]
    if chunked_id != -1:
        last = int(ids[T - 1]) if A else None
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
    lengths = table.rows[FIELD_KV_OFFSET, P:T].astype(np.int64) + table.rows[FIELD_QUERY, P:T] + 1
    if lengths.size and lengths.max() > max_sequence_length and \
            (too_long := mask & (lengths > max_sequence_length)).any():
        max_length_ids = ids[P:T][too_long].astype(np.int64)
        mask = mask & ~too_long

    allocator = table.allocator
    scratch = _Scratch(table, AllocatorSimulation(allocator) if allocator.keeps_idle_blocks
                       else _StackSim(allocator))
    h = scratch.h
    a = int(mask.sum())
    finished_ids = h[FIELD_IDS, P:T][~mask].astype(np.int64)
    paused_now = _EMPTY
    evicted = _EMPTY
    if a + P == 0:
        scratch.release(np.arange(P, T))
        P = T = 0
    else:
        finished_rows = P + np.flatnonzero(~mask)
        if finished_rows.size:
            scratch.release(finished_rows)
            if a > 0:
                holes = P + np.flatnonzero(~mask[:a])
                movers = P + a + np.flatnonzero(mask[a:])
                if holes.size:
                    scratch.move(holes, movers)
                    scratch.clear(movers)
        T = P + a
        if a > 0:
            need = h[FIELD_LAST_OFFSET, P:T] == table.block_size - 1
            if chunked_id != -1:
                need &= h[FIELD_IDS, P:T] != chunked_id
            k = int(need.sum())
            if k:
                paused_now = h[FIELD_IDS, P:T][need].astype(np.int64)
                if k < a:
                    left_keep = np.flatnonzero(~need[:k])
                    right_need = k + np.flatnonzero(need[k:])
                    scratch.move(P + np.concatenate([left_keep, right_need]),
                                 P + np.concatenate([right_need, left_keep]))
                P, a = P + k, a - k
        P, a = scratch.resume(P, a, allocator.active_count)
        P, evicted = scratch.evict(P, a, allocator.paused_count)
        P, a = scratch.resume(P, a, allocator.active_count)
        T = P + a
        if a == 0:
            paused_blocks = (distinct_blocks(scratch.held(np.arange(P))).size if scratch.distinct
                             else int(h[FIELD_BLOCKS, :P].sum()))
            raise RuntimeError(
                f"no request can run: {P} paused requests hold {paused_blocks} blocks and none "
                f"can resume ({scratch.stack.total_avail} free blocks, active budget "
                f"{allocator.active_count}); nothing was changed")
        if chunked_id != -1:
            row = P + int(np.flatnonzero(h[FIELD_IDS, P:T] == chunked_id)[0])
            if row != T - 1:
                scratch.move(np.array([row, T - 1]), np.array([T - 1, row]))
        # The next step is a pure decode unless requests are added.
        h[FIELD_KV_OFFSET, P:T] += h[FIELD_QUERY, P:T]
        h[FIELD_QUERY, P:T] = 1
        h[FIELD_LAST_OFFSET, P:T] = (h[FIELD_LAST_OFFSET, P:T] + 1) % table.block_size
    newly_paused = _EMPTY
    if P and paused_now.size:
        still_paused = h[FIELD_IDS, :P].astype(np.int64)
        newly_paused = still_paused[np.isin(still_paused, paused_now)]
    slots = np.concatenate(scratch.slots) if scratch.slots else np.empty(0, dtype=np.int32)
    return UpdatePlan(
        old_paused=old_P, old_total=old_T, paused=P, total=T, active_tokens=T - P,
        origin=scratch.origin, rows=h, append_col=scratch.append_col,
        append_block=scratch.append_block, allocator_ops=tuple(scratch.stack.ops),
        released_slots=slots, finished_ids=finished_ids, evicted_ids=evicted,
        newly_paused_ids=newly_paused, max_length_ids=max_length_ids)
