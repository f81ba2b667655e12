"""The request table: every request's host row, the block table, and the block bookkeeping.

Rows are laid out ``[paused | active | free]`` as in Megatron-Core; active rows hold decode
requests first, then prefills, a chunked prefill last. The table is host-only (numpy): its
per-request integers and metadata are views into the host half of the device state's arena
(``staging.HostArena``), handed over by ``bind``, so that one copy uploads them.

It changes only through ``commit_add``, ``commit_update`` and ``commit_decode``, which apply a
plan computed beforehand (``admission.plan_add``, ``update_plan.plan_update``,
``update_plan.plan_decode``) from the unchanged table. The plans carry every check; a commit
cannot fail on a plan made from the current table.

The table owns the block bookkeeping its rows use: it builds the ``KVBlockAllocator`` (which
reads the budgets' usage back from the table through a weak reference) and, with prefix
caching, the ``PrefixCache`` over it; a hybrid's Mamba slot stack is ``MambaStates``' and
handed in.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._fields import (
    _FIELD_RESET,
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_OUTPUT,
    FIELD_QUERY,
)
from .admission import AddPlan, DummyPlan, plan_add, plan_dummies
from .errors import TensorStateDeallocatedError
from .inputs import check_chunked_id, check_request_limit
from .kv_block_allocator import KVBlockAllocator
from .mamba_states import MambaSnapshots, SlotAllocator
from .plan_scratch import distinct_blocks, held_blocks
from .prefix_cache import DigestTable, PrefixCache
from .update_plan import DecodePlan, UpdatePlan, plan_decode, plan_update


class RequestTable:
    """Host rows of the live requests, the block allocator and the prefix cache.

    Args:
        total_blocks, paused_blocks: the allocator's blocks (the dummy included) and paused
            budget; the allocator outlives ``unbind`` (suspending resets it).
        max_requests, max_kv_block_count, block_size: the table's sizes.
        metadata_labels: request metadata labels, in the context's order.
        hybrid: whether every request owns a Mamba state slot (from ``slots``).
        max_tokens: tokens of one step (the staged prompt tokens).
        slots: a hybrid's Mamba slot stack (``MambaStates.slots``).
        prefix_caching: the eviction policy with prefix caching on ("ref_zero" or "lru"), else
            None; snapshots: a hybrid's Mamba state snapshots for it.
        budget_advice: ``sizing.MemoryLayout.advice`` (which argument gives the active budget
            the blocks an update where no request can run lacks).
        speculative: ``num_speculative_tokens`` (k): a decode row holds ``1 + k`` tokens a
            step and takes its next block early (docs/SEMANTICS.md §19).
    """

    offload = None   # KV offload's host copies (``offload.Offload``), set by build_parts
    def __init__(self, *, total_blocks: int, paused_blocks: int, max_requests: int,
                 max_kv_block_count: int, block_size: int, metadata_labels: list, hybrid: bool,
                 max_tokens: int, slots: Optional[SlotAllocator] = None,
                 prefix_caching: Optional[str] = None,
                 snapshots: Optional[MambaSnapshots] = None, budget_advice=None,
                 speculative: int = 0):
        digests = None if prefix_caching is None else DigestTable()
        self.allocator = KVBlockAllocator(
            None, total_blocks, paused_blocks, prefix_caching is not None, prefix_caching
            or "ref_zero", usage=self, on_evict=None if digests is None else digests.forget)
        self.prefix_cache = None if prefix_caching is None else PrefixCache(
            self.allocator, digests, block_size, prefix_caching, snapshots)
        if digests is not None and snapshots is not None:
            digests.on_forget = snapshots.drop
        self.budget_advice = budget_advice
        self.max_requests = max_requests
        # The rows add_request may fill: the context's ``max_requests``, which callers may lower.
        self.request_limit = max_requests
        self.max_kv_block_count = max_kv_block_count
        self.block_size = block_size
        self.metadata_labels = list(metadata_labels)
        self.hybrid = hybrid
        self.max_tokens = max_tokens
        self.speculative = speculative
        self.decode_query = 1 + speculative
        self.rows: Optional[np.ndarray] = None
        self.block_table: Optional[np.ndarray] = None
        self.metadata: dict = {}
        self.slots = slots
        self._zero_slots: Optional[np.ndarray] = None
        self.prompt: Optional[np.ndarray] = None
        self._clear_counts()

    # ------------------------------------------------------------------ lifetime
    def bind(self, rows: np.ndarray, metadata: dict, zero_slots: Optional[np.ndarray]) -> None:
        """Take the arena's host views (int32 ``[NUM_FIELDS, R]`` rows, ``label -> [R]``
        metadata, int64 ``[R]`` Mamba zero-slot list) and allocate the host-only arrays."""
        self.rows, self.metadata, self._zero_slots = rows, metadata, zero_slots
        num_rows, row_blocks = self.max_requests, self.max_kv_block_count
        self.block_table = np.full((num_rows, row_blocks), -1, dtype=np.int32)
        # The block table as one opaque value per row (moving rows is then a one-dimensional
        # copy, several times faster than a two-dimensional fancy index).
        self.block_rows = self.block_table.view(np.dtype((np.void, 4 * row_blocks))).reshape(
            num_rows)
        self.row_numbers = np.arange(num_rows)
        self.prompt = np.zeros(self.max_tokens, dtype=np.int64)
        # The bytes of int32 ones (a decode step's query lengths, one memcmp) and of an int32
        # block_size - 1 (a full block's last offset, which plan_decode finds as bytes).
        self.one_bytes = np.ones(self.max_requests, dtype=np.int32).tobytes()
        self.full_block_bytes = np.int32(self.block_size - 1).tobytes()
        self.reset()

    def unbind(self) -> None:
        """Drop every host array (suspend); the requests in flight are forgotten."""
        self.rows = self.block_table = self.prompt = self._zero_slots = None
        self.block_rows = None
        self.metadata = {}
        self.allocator.reset()
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        self._clear_counts()

    @property
    def bound(self) -> bool:
        return self.rows is not None

    def _clear_counts(self) -> None:
        self.paused = 0
        self.total = 0
        self.active_tokens = 0
        self.num_prefill = 0
        # Dummy rows counted as decode whose tokens come from the prompt buffer (they follow
        # the real decode rows): add_dummy_requests_parallel(count_as_prefill=False).
        self.fed_decode = 0
        self.continuation_added = False
        # The request whose last chunk left prompt tokens behind (the only valid continuation),
        # and the context's ``chunked_prefill_request_id`` (-1: none).
        self.partial_id = -1
        self.chunked_id = -1
        self.live_ids: set = set()
        self.dirty_from = self.max_requests
        self.zero_count = 0
        self.device_prompts: list = []
        # Prefix caching on hybrids: (slot, snapshot) copies before each build of the step.
        self.mamba_restores: list = []
        # Prefix caching: (first token, count) of the step's tokens inside shared blocks,
        # whose K/V writes the dummy block takes (the blocks hold their K/V already).
        self.discard_writes: list = []

    def reset(self, keep_cache: bool = False) -> None:
        """Every row free, every block and slot free (the KV bytes are kept); ``keep_cache``:
        the prefix cache kept, the rows' blocks released a reference each (0.19)."""
        if keep_cache and self.total:
            held = self.block_table[:self.total]
            self.allocator.release_memory_blocks(
                held[(held >= 0) & (held != self.allocator.dummy_block_idx)])
            self.prefix_cache.pending.clear()
        self._clear_counts()
        self.rows[:] = 0
        for field, value in _FIELD_RESET.items():
            self.rows[field] = value
        for values in self.metadata.values():
            values[:] = 0
        self.block_table.fill(-1)
        if not keep_cache:
            self.allocator.reset()
        if self.prefix_cache is not None and not keep_cache:
            self.prefix_cache.reset()
        if self.slots is not None:
            self.slots.reset()

    def reset_slots(self) -> None:
        """Every Mamba slot free (no live request may hold one)."""
        self.slots.reset()
        self.rows[FIELD_MAMBA_SLOT] = -1
        self.zero_count = 0

    # ------------------------------------------------------------------ queries
    @property
    def active(self) -> int:
        return self.total - self.paused

    @property
    def num_decode(self) -> int:
        return self.total - self.paused - self.num_prefill

    def active_used_blocks(self) -> int:
        """Blocks of the active rows against the active budget: their block counts, or with
        prefix caching the distinct blocks they hold (docs/SEMANTICS.md §17.4); 0 unbound."""
        if not self.bound:
            return 0
        if self.prefix_cache is not None:
            return int(self._held_distinct(self.paused, self.total).size)
        return int(self.rows[FIELD_BLOCKS, self.paused:self.total].sum())

    def paused_used_blocks(self) -> int:
        """Blocks of the paused rows against the paused budget: their block counts, or with
        prefix caching the distinct blocks they hold that no active row holds; 0 unbound."""
        if not self.bound:
            return 0
        if self.prefix_cache is not None:
            paused = self._held_distinct(0, self.paused)
            return int(np.setdiff1d(paused, self._held_distinct(self.paused, self.total),
                                    assume_unique=True).size)
        return int(self.rows[FIELD_BLOCKS, :self.paused].sum())

    def _held_distinct(self, start: int, stop: int) -> np.ndarray:
        return distinct_blocks(held_blocks(self.block_table[start:stop],
                                           self.rows[FIELD_BLOCKS, start:stop],
                                           self.allocator.dummy_block_idx))

    def ids(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        return self.rows[FIELD_IDS, start:self.total if stop is None else stop]

    # ------------------------------------------------------------------ Megatron's queries
    def check_bound(self, request_id: Optional[int] = None) -> None:
        if self.rows is None:
            raise TensorStateDeallocatedError.suspended(request_id)

    def host(self, name: str) -> np.ndarray:
        """The host array ``name`` (``rows``, ``block_table``: no sync) of a bound table."""
        self.check_bound()
        return getattr(self, name)

    def host_request_ids(self) -> np.ndarray:
        """Host copy of the request id of each row in ``[0, total_request_count)``."""
        return self.host("rows")[FIELD_IDS, :self.total]

    def set_chunked_id(self, value) -> None:
        """Keep the context's ``chunked_prefill_request_id`` (``inputs.check_chunked_id``)."""
        last = int(self.rows[FIELD_IDS, self.total - 1]) if self.bound and self.active else None
        self.chunked_id = check_chunked_id(value, last, self.active)

    def set_request_limit(self, value) -> None:
        """Lower (or restore) the context's ``max_requests`` (``inputs.check_request_limit``)."""
        self.request_limit = check_request_limit(value, self.total, self.max_requests)

    # ------------------------------------------------------------------ plans (pure)
    def plan_add(self, req, chunk_length, **limits) -> AddPlan:
        """``admission.plan_add`` against this table: every check, nothing changed."""
        return plan_add(self, req, chunk_length, **limits)

    def plan_dummies(self, requests, count_as_prefill: bool, **limits) -> DummyPlan:
        """``admission.plan_dummies`` against this table: every check, nothing changed."""
        return plan_dummies(self, requests, count_as_prefill, **limits)

    def plan_update(self, mask: np.ndarray, *, chunked_id: int, max_sequence_length: int,
                    draft_counts: Optional[np.ndarray] = None) -> UpdatePlan:
        """``update_plan.plan_update`` against this table: every check, nothing changed."""
        return plan_update(self, mask, chunked_id=chunked_id,
                           max_sequence_length=max_sequence_length, draft_counts=draft_counts)

    def plan_decode(self, *, chunked_id: int, max_sequence_length: int,
                    max_kv_offset: Optional[int] = None, active_blocks: Optional[int] = None,
                    plain: bool = False) -> Optional[DecodePlan]:
        """``update_plan.plan_decode`` against this table: the plan of the steady decode update
        of a mask that keeps every request, or None (then ``plan_update``); nothing changed."""
        return plan_decode(self, chunked_id=chunked_id, max_sequence_length=max_sequence_length,
                           max_kv_offset=max_kv_offset, active_blocks=active_blocks,
                           plain=plain)

    # ------------------------------------------------------------------ commits
    def commit_add(self, plan: AddPlan) -> None:
        """Apply an ``admission.AddPlan`` made from this table: reserve and write."""
        rows, row = self.rows, plan.row
        if self.prefix_cache is not None:
            # The matched blocks get their references before any allocation can evict them.
            matched = self.prefix_cache.commit_add(plan.request_id, plan.prefix, plan.chunk)
        new_blocks = self.allocator.allocate_memory_blocks_host(plan.needed - plan.already)
        if plan.is_continuation:
            self.continuation_added = True
        else:
            rows[:, row] = 0
            rows[FIELD_IDS, row] = plan.request_id
            rows[FIELD_MAMBA_SLOT, row] = -1
            if self.hybrid:
                # A new request starts from zero Mamba state; the zeroing is flushed per step.
                # A prefix cache hit starts from its snapshot instead, as the step's
                # continuation (the last row, from its saved state).
                slot = self.slots.allocate()
                rows[FIELD_MAMBA_SLOT, row] = slot
                if plan.prefix is not None and plan.prefix.resumes:
                    if plan.prefix.snapshot >= 0:   # (a host one: Offload.commit_add)
                        self.mamba_restores.append((slot, plan.prefix.snapshot))
                    self.continuation_added = True
                else:
                    self._zero_slots[self.zero_count] = slot
                    self.zero_count += 1
            self.block_table[row] = -1
            if plan.prefix is not None and plan.already:
                self.block_table[row, :plan.already] = matched
            for label, value in zip(self.metadata_labels, plan.metadata):
                self.metadata[label][row] = value
            self.live_ids.add(plan.request_id)
        self.block_table[row, plan.already:plan.needed] = new_blocks
        if self.prefix_cache is not None:  # 0.19: the chunk's full blocks are shared at once
            self.prefix_cache.publish_added(plan.request_id, self.block_table[row],
                                            plan.finished + plan.chunk)
            if plan.prefix is not None and plan.prefix.discard_tokens:
                self.discard_writes.append((plan.tokens_before, plan.prefix.discard_tokens))
        rows[FIELD_QUERY, row] = plan.chunk
        rows[FIELD_OUTPUT, row] = plan.finished + plan.chunk + plan.gen
        rows[FIELD_KV_OFFSET, row] = plan.finished
        rows[FIELD_BLOCKS, row] = plan.needed
        rows[FIELD_LAST_BLOCK, row] = self.block_table[row, plan.needed - 1]
        rows[FIELD_LAST_OFFSET, row] = (plan.finished + plan.chunk - 1) % self.block_size
        self.dirty_from = min(self.dirty_from, row)
        offset, chunk = plan.prompt_offset, plan.chunk
        if plan.host_prompt is not None:
            self.prompt[offset:offset + chunk] = plan.host_prompt
        else:
            self.device_prompts.append((plan.device_prompt, offset))
        self.active_tokens = plan.tokens_before + chunk
        if not plan.is_continuation:
            self.total += 1
        self.num_prefill += 1
        self.partial_id = plan.request_id if plan.partial else -1

    def commit_dummies(self, plan) -> np.ndarray:
        """Apply an ``admission.DummyPlan``: rows whose every block is the dummy block, no block
        allocated. Returns the Mamba slots handed out (hybrids; empty otherwise)."""
        n = plan.ids.size
        rows = slice(plan.row, plan.row + n)
        dummy = self.allocator.dummy_block_idx
        self.rows[:, rows] = 0
        self.rows[FIELD_IDS, rows] = plan.ids
        self.rows[FIELD_QUERY, rows] = plan.lengths
        self.rows[FIELD_OUTPUT, rows] = plan.lengths + plan.gens
        self.rows[FIELD_BLOCKS, rows] = plan.blocks
        self.rows[FIELD_LAST_BLOCK, rows] = dummy if n else -1
        self.rows[FIELD_LAST_OFFSET, rows] = (plan.lengths - 1) % self.block_size
        self.rows[FIELD_MAMBA_SLOT, rows] = -1
        columns = np.arange(self.max_kv_block_count)
        self.block_table[rows] = np.where(columns[None, :] < plan.blocks[:, None], dummy, -1)
        for i, values in enumerate(plan.metadata):
            for label, value in zip(self.metadata_labels, values):
                self.metadata[label][plan.row + i] = value
        slots = np.empty(0, dtype=np.int64)
        if self.hybrid and n:
            slots = np.array([self.slots.allocate() for _ in range(n)], dtype=np.int64)
            self.rows[FIELD_MAMBA_SLOT, rows] = slots
        offset = plan.prompt_offset
        for length, host, on_device in zip(plan.lengths.tolist(), plan.host_prompts,
                                           plan.device_prompts):
            if host is not None:
                self.prompt[offset:offset + length] = host
            else:
                self.device_prompts.append((on_device, offset))
            offset += length
        self.live_ids.update(plan.ids.tolist())
        self.dirty_from = min(self.dirty_from, plan.row)
        self.total += n
        self.active_tokens += int(plan.lengths.sum())
        if plan.count_as_prefill:
            self.num_prefill += n
        else:
            self.fed_decode += n
        return slots

    def commit_update(self, plan: UpdatePlan) -> None:
        """Apply an ``update_plan.UpdatePlan`` made from this table."""
        allocator = self.allocator
        for op, arg in plan.allocator_ops:
            if op == "release":
                allocator.release_memory_blocks(arg)
            else:
                allocator.allocate_memory_blocks_host(arg)
        if self.slots is not None and plan.released_slots.size:
            self.slots.release(plan.released_slots)
        old_total, total = plan.old_total, plan.total
        origin = plan.origin
        moved = np.flatnonzero(origin != np.arange(old_total))
        if moved.size:
            sources = origin[moved]
            # Fancy indexing on the right copies first, so overlapping moves are safe.
            self.block_rows[moved] = self.block_rows[sources]
            for values in self.metadata.values():
                values[moved] = values[sources]
        self.rows[:, :old_total] = plan.rows
        self.block_table[total:old_total] = -1
        if plan.allocator_ops:
            appended = np.flatnonzero(plan.append_col >= 0)
            self.block_table[appended, plan.append_col[appended]] = plan.append_block[appended]
        self.paused, self.total = plan.paused, total
        self.active_tokens = plan.active_tokens
        self.num_prefill = 0
        self.fed_decode = 0
        self.continuation_added = False
        self.device_prompts = []
        self.mamba_restores, self.discard_writes = [], []
        self.dirty_from = self.max_requests
        gone = plan.finished_ids.tolist() + plan.evicted_ids.tolist()
        self.live_ids.difference_update(gone)
        if self.partial_id in gone:
            self.partial_id = -1

    def commit_decode(self, plan: DecodePlan) -> Optional[tuple]:
        """Apply an ``update_plan.DecodePlan`` made from this table (as ``commit_update`` would
        apply ``plan_update``'s plan of the same update). Returns None, or for the rows that
        start a block, now rows ``[0, filled)``: ``(columns, blocks)``, where each appended its
        block in the block table."""
        rows, total, per_row = self.rows, self.total, plan.per_row
        kv_offsets, last_offsets = rows[FIELD_KV_OFFSET, :total], rows[FIELD_LAST_OFFSET, :total]
        if plan.kv_offsets is None:
            # Every row held one token: the KV offsets advance by one.
            np.add(kv_offsets, 1, out=kv_offsets)
        else:
            kv_offsets[:] = plan.kv_offsets
            rows[FIELD_QUERY, :total] = per_row
        np.add(last_offsets, per_row, out=last_offsets)
        if per_row > 1:   # speculative: the rows that cross a block end past its start
            np.remainder(last_offsets, self.block_size, out=last_offsets)
        appended = None
        if plan.full is not None:
            # The rows that filled their last block move to the front rows [0, filled) (fancy
            # indexing on the right copies first: the swaps are safe), and each starts a new
            # block, allocated in the order of the rows.
            dst, src = plan.dst, plan.src
            if dst.size:
                rows[:, dst] = rows[:, src]
                self.block_rows[dst] = self.block_rows[src]
                for values in self.metadata.values():
                    values[dst] = values[src]
            filled = len(plan.full)
            blocks = self.allocator.allocate_memory_blocks_host(filled)
            columns = rows[FIELD_BLOCKS, :filled].copy()
            # A two-dimensional index, not a flat one, whose bounds hold per row (plan_decode
            # already left a count outside the table to the general path, which raises).
            self.block_table[self.row_numbers[:filled], columns] = blocks
            rows[FIELD_BLOCKS, :filled] = columns + 1
            rows[FIELD_LAST_BLOCK, :filled] = blocks
            if per_row == 1:
                rows[FIELD_LAST_OFFSET, :filled] = 0
            appended = (columns, blocks)
        self.active_tokens = total * per_row
        self.num_prefill = 0
        self.fed_decode = 0
        self.continuation_added = False
        if self.device_prompts:
            self.device_prompts = []
        self.dirty_from = self.max_requests
        return appended

    def commit_rewind(self, plan) -> None:
        """Apply a ``speculative.RewindPlan`` made from this table: the rewound rows' offsets,
        block counts and last blocks, the dropped blocks (one or more a row) cleared from their
        rows and released (with prefix caching, a reference each: such a block is never
        published, as the plans check)."""
        rows = plan.rows
        self.rows[FIELD_KV_OFFSET, rows] = plan.kv_offsets
        self.rows[FIELD_LAST_OFFSET, rows] = plan.last_offsets
        self.rows[FIELD_BLOCKS, rows] = plan.block_counts
        self.rows[FIELD_LAST_BLOCK, rows] = plan.last_blocks
        if plan.dropped.size:
            columns = self.rows[FIELD_BLOCKS, plan.dropped] if plan.columns is None \
                else plan.columns
            self.block_table[plan.dropped, columns] = -1
            self.allocator.release_memory_blocks(plan.released)

    def permute_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Rows ``dst`` take the fields, metadata and block-table rows of rows ``src`` (read
        before any write, so that a swap passes ``dst + src, src + dst``)."""
        self.rows[:, dst] = self.rows[:, src]
        for values in self.metadata.values():
            values[dst] = values[src]
        self.block_rows[dst] = self.block_rows[src]
        if dst.size:
            self.dirty_from = min(self.dirty_from, int(dst.min()))

    def check_step_ready(self) -> None:
        """Refuse a step that would forward the chunked prefill request's placeholder token:
        its K/V could land where no block exists (docs/SEMANTICS.md §10)."""
        if self.chunked_id != -1 and self.num_prefill == 0 and self.active:
            raise RuntimeError(
                f"the chunked prefill request {self.chunked_id} needs its next chunk "
                "(add_request) before this step; a step without it would forward its "
                "placeholder token")

    def take_staged(self) -> tuple:
        """``(zero_count, device_prompts)`` staged by ``commit_add``: the Mamba slots to zero
        (consumed: zeroed once) and the prompts already on the device (kept until the update,
        so that building the step again re-copies them over the host prompt upload)."""
        staged = (self.zero_count, list(self.device_prompts) if self.device_prompts else ())
        self.zero_count = 0
        return staged

    def dirty_rows(self) -> tuple:
        """``(lo, hi)``: block-table rows ``commit_add`` changed since the last upload; clears."""
        lo, self.dirty_from = self.dirty_from, self.max_requests
        return lo, self.total
