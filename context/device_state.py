"""Device state of the context: the arena, the staging ring, the block tables, the step's token
arrays and the pending next tokens, the launches that update them, and the bookkeeping tensors
the context hands out.

The device mirrors the request table. ``begin_step`` uploads what changed (one arena copy, the
new block-table rows, the prompt tokens) and builds the step's per-token arrays in one
``step_metadata`` launch; ``apply_update`` applies an update plan's row permutation to the
double-buffered block tables and pending tokens in one ``compact_requests`` launch, and
``apply_decode`` does the same for a decode update (``update_plan.DecodePlan``). On a CPU device
the arena is the host memory itself: nothing is uploaded. Every buffer here is allocated by the
context and checked once, so the launches skip the launchers' checks (``check=False``); the
inputs a user hands in are checked at the context's edge. The views the launches and the
attention metadata take are cut once per row range and reused while it stays the same.

The part lives as long as the context; its tensors are allocated by ``allocate`` and dropped by
``release`` (suspend). ``field_view``, ``block_table_view``, ``metadata_views`` and
``pull_bookkeeping`` hand out the per-request bookkeeping as Megatron-Core's tests write it: host
views on a CPU device (``host_views``), the device mirrors on CUDA (docs/DESIGN.md §2).
Speculative steps (``speculative`` > 0) keep the rows' drafts in ``spec`` (a
``draft_rows.DraftRows``), moved with the rows (a few torch operations more an update, two
more a step: docs/SEMANTICS.md §19).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from dynctx.kernels.compaction import compact_requests
from dynctx.kernels.step_metadata import step_metadata

from ._fields import FIELD_KV_OFFSET, FIELD_QUERY, NUM_FIELDS
from .draft_rows import DraftRows
from .errors import TensorStateDeallocatedError
from .inputs import check_paused_tokens
from .staging import HostArena, HostToDevice

TOKEN_ARRAYS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                "token_to_block_idx", "token_to_position_in_request",
                "token_to_local_position_within_kv_block")
# What ``allocate`` builds and ``release`` drops.
_ALLOCATED = TOKEN_ARRAYS + ("arena", "h2d", "block_tables", "next_tokens", "attn_block_table",
                             "prompt_tokens")


class DeviceState:
    """The context's device tensors but the KV cache's and the Mamba states.

    Args:
        device, backend: where the tensors live and the resolved kernel backend.
        max_requests, max_tokens, max_kv_block_count: sizes.
        metadata_types: ``[(label, dtype, on_device)]`` of the request metadata.
        hybrid: whether the arena holds the step's Mamba sections.
        speculative: ``num_speculative_tokens`` (k); k > 0 keeps each row's pending drafts
            and the step's logit rows in ``spec`` (``draft_rows.DraftRows``; docs/SEMANTICS.md
            §19).
    """

    def __init__(self, *, device: torch.device, backend: str, max_requests: int,
                 max_tokens: int, max_kv_block_count: int, metadata_types: list, hybrid: bool,
                 speculative: int = 0):
        self.device, self.backend = device, backend
        self.speculative = speculative
        self.spec = DraftRows(speculative, max_requests, max_tokens, device) \
            if speculative else None
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.max_kv_block_count = max_kv_block_count
        self.hybrid = hybrid
        rows = max_requests   # request rows
        sections = [("req", torch.int32, (NUM_FIELDS, rows))]
        sections += [(f"meta:{label}", dtype, (rows,)) for label, dtype, _ in metadata_types]
        sections += [("attn_query_lengths", torch.int32, (rows,)),
                     ("attn_cu_query", torch.int32, (rows + 1,)),
                     ("attn_cu_kv", torch.int32, (rows + 1,)),
                     ("attn_kv_lengths", torch.int32, (rows,)),
                     ("plan_src", torch.int32, (rows,)),
                     ("plan_col", torch.int32, (rows,)),
                     ("plan_block", torch.int32, (rows,))]
        if hybrid:
            sections += [("mamba_decode_slots", torch.int32, (rows,)),
                         ("mamba_prefill_slots", torch.int32, (rows,)),
                         ("mamba_chunked_slot", torch.int32, (1,)),
                         ("mamba_cu_seqlens", torch.int32, (rows + 1,)),
                         ("mamba_zero_slots", torch.int64, (rows,))]
        self._sections = sections
        self.metadata_labels = [label for label, _, _ in metadata_types]
        # Whether the bookkeeping tensors handed out are host views (a CPU device; tests set it
        # False to run the CUDA path on a CPU: the arena then stops sharing the host buffer).
        self.host_views = device.type == "cpu"
        # Row numbers 0..R-1 and -1s: a decode update's identity plan, written from these.
        self.row_numbers = np.arange(rows, dtype=np.int32)
        self.no_append = np.full(rows, -1, dtype=np.int32)
        self.allocated = False
        for name in _ALLOCATED:
            setattr(self, name, None)

    def nbytes(self) -> int:
        """Device bytes ``allocate`` takes (about: the arena, the three block tables, the next
        tokens and the step's token arrays)."""
        rows, tokens, row_blocks = self.max_requests, self.max_tokens, self.max_kv_block_count
        arena = sum(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
                    for _, dtype, shape in self._sections)
        drafts = self.spec.nbytes() if self.spec is not None else 0
        return (arena + 3 * 4 * rows * row_blocks + 2 * 8 * rows
                + (len(TOKEN_ARRAYS) + 1) * 8 * tokens + drafts)

    def allocate(self) -> None:
        """Allocate every tensor (at construction, and on resume after a suspend)."""
        rows, tokens, row_blocks = self.max_requests, self.max_tokens, self.max_kv_block_count
        device = self.device
        self.arena = HostArena(self._sections, device)
        capacity = self.arena.nbytes + 4 * rows * row_blocks + 2 * 8 * tokens + 4096
        self.h2d = HostToDevice(device, capacity)
        self.block_tables = [torch.full((rows, row_blocks), -1, dtype=torch.int32, device=device)
                             for _ in range(2)]
        self.next_tokens = [torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(2)]
        self.current = 0
        self.rows_used = [0, 0]
        # A CPU context hands out host views of the block table: once one was handed out, the
        # next step (or update) refreshes the device table from the host, then clears this.
        self.host_table_written = False
        self.attn_block_table = torch.full((rows, row_blocks), -1, dtype=torch.int32, device=device)
        for name in TOKEN_ARRAYS:
            setattr(self, name, torch.zeros(tokens, dtype=torch.int64, device=device))
        self.prompt_tokens = torch.zeros(tokens, dtype=torch.int64, device=device)
        if self.spec is not None:
            self.spec.allocate()
        # Between updates, rows [0, identity_plan_rows) of the arena's plan hold the identity
        # plan (0: unknown).
        self.identity_plan_rows = 0
        self._step_views: dict = {}
        self._attn_views: dict = {}
        if (not self.host_views or self.deferred_rewind) and device.type == "cpu":
            self.share_arena(False)
        self.allocated = True

    def release(self) -> None:
        """Drop every tensor (suspend)."""
        for name in _ALLOCATED:
            setattr(self, name, None)
        if self.spec is not None:
            self.spec.release()
        self._step_views = self._attn_views = {}
        self.allocated = False

    def check_allocated(self, request_id: Optional[int] = None) -> None:
        if not self.allocated:
            raise TensorStateDeallocatedError.suspended(request_id)

    @property
    def deferred_rewind(self) -> bool:
        return self.spec is not None and self.spec.deferred

    def defer_rewinds(self) -> None:
        """Rewinds from now on are deferred (``DraftRows``): the device's rows then differ
        from the host's until the host settles them, so a CPU device's arena stops sharing
        the host buffer (as on CUDA)."""
        if not self.spec.deferred:
            self.spec.deferred = True
            if self.allocated and self.device.type == "cpu":
                self.share_arena(False)

    def set_host_views(self, value: bool) -> None:
        """Hand out host views (True) or the device mirrors (False); on a CPU device the arena
        shares the host buffer exactly when host views are handed out."""
        self.host_views = bool(value)
        if self.allocated and self.device.type == "cpu":
            self.share_arena(self.host_views and not self.deferred_rewind)

    def share_arena(self, shared: bool) -> None:
        """On a CPU device: whether the arena's device side is the host buffer itself (the
        default) or a separate copy, as on CUDA (``HostArena.set_shared``)."""
        if shared != self.arena.shared:
            self.arena.set_shared(shared)
            self._step_views.clear()
            self._attn_views.clear()

    def table_views(self) -> tuple:
        """The arena's host views the request table binds: rows, metadata, Mamba zero slots."""
        host = self.arena.host
        return (host["req"], {label: host[f"meta:{label}"] for label in self.metadata_labels},
                host.get("mamba_zero_slots"))

    def reset(self) -> None:
        """Device mirrors of an empty table (the KV bytes are kept)."""
        self.arena.flush(self.h2d)
        for table in self.block_tables:
            table.fill_(-1)
        for tokens in self.next_tokens:
            tokens.zero_()
        if self.spec is not None:
            self.spec.drafts.zero_()
            self.spec.lags.zero_()
        self.rows_used = [0, 0]
        self.host_table_written = False
        self.attn_block_table.fill_(-1)
        self.token_to_request_idx.fill_(-1)
        self.token_to_block_idx.fill_(-1)
        for name in ("token_to_input_ids", "token_to_pos_ids", "token_to_position_in_request",
                     "token_to_local_position_within_kv_block"):
            getattr(self, name).zero_()

    @property
    def block_table(self) -> torch.Tensor:
        return self.block_tables[self.current]

    def sync(self) -> None:
        """Upload the arena if the host changed it since the last upload."""
        if self.arena.dirty:
            self.arena.flush(self.h2d)

    def flush_block_rows(self, table) -> None:
        """Upload the block-table rows that ``add_request`` changed."""
        lo, hi = table.dirty_rows()
        if lo < hi:
            self.h2d.copy(self.block_tables[self.current][lo:hi], table.block_table[lo:hi])
            self.rows_used[self.current] = max(self.rows_used[self.current], hi)

    def upload_block_table(self, table, rows: int) -> None:
        """Copy host block-table rows ``[0, rows)`` (and any stale rows past them) to the
        current device table, after writes through a host view."""
        hi = max(rows, self.rows_used[self.current])
        if hi:
            self.h2d.copy(self.block_tables[self.current][:hi], table.block_table[:hi])
        self.rows_used[self.current] = max(self.rows_used[self.current], rows)
        table.dirty_rows()
        self.host_table_written = False

    def mirrors(self, table) -> dict:
        """The device copies of the request table, brought up to date first: ``req`` (int32
        ``[NUM_FIELDS, R]``), ``metadata`` (label -> ``[R]``) and ``block_table``. For checks
        that the device mirrors the host (the public views are host views on a CPU device)."""
        self.sync()
        if self.host_table_written:
            self.upload_block_table(table, table.total)
        else:
            self.flush_block_rows(table)
        device = self.arena.device
        return dict(req=device["req"], block_table=self.block_table,
                    metadata={label: device[f"meta:{label}"] for label in self.metadata_labels})

    def step_views(self, paused: int, total: int) -> tuple:
        """The views ``step_metadata`` reads for active rows ``[paused, total)`` of the current
        block table: ``(block_table, query_lengths, kv_offsets, next_tokens)``, cut once per
        (rows, buffer) and reused."""
        key = (paused, total, self.current)
        views = self._step_views.get(key)
        if views is None:
            if len(self._step_views) >= 8:
                self._step_views.clear()
            req = self.arena.device["req"]
            views = self._step_views[key] = (
                self.block_tables[self.current][paused:total], req[FIELD_QUERY, paused:total],
                req[FIELD_KV_OFFSET, paused:total], self.next_tokens[self.current][paused:total])
        return views

    def begin_step(self, step, table, device_prompts: list, mamba: tuple = ()) -> None:
        """Upload the step's host state and build its per-token arrays (one launch); with a
        deferred rewind, the rows' lags first (``DraftRows.apply_lags``; ``mamba``: a hybrid's
        state tensors)."""
        self.arena.flush(self.h2d)
        if self.host_table_written:
            self.upload_block_table(table, table.total)
        else:
            self.flush_block_rows(table)
        if self.spec is not None and self.spec.deferred and step.active:
            self.spec.apply_lags(step, self.arena.device, mamba, self.backend)
        num_prompt = step.prompt_tokens
        # Speculative steps: the drafted rows' tokens are written on the device below.
        start = int(self.arena.host["attn_cu_query"][step.drafted]) if step.drafted else 0
        if num_prompt > start:
            self.h2d.copy(self.prompt_tokens[start:num_prompt], table.prompt[start:num_prompt])
        for tensor, offset in device_prompts:
            self.prompt_tokens[offset:offset + tensor.numel()].copy_(tensor)
        paused = step.paused
        block_table, query_lengths, kv_offsets, next_tokens = self.step_views(paused, step.total)
        if step.drafted:
            # Speculative decode rows: pending token, then drafts, at the front of the prompt
            # buffer (the kernel feeds every row from it).
            self.spec.write_row_tokens(step, table, next_tokens, self.prompt_tokens,
                                       self.arena.host["attn_cu_query"], self.h2d)
        step_metadata(
            self.token_to_input_ids, self.token_to_pos_ids, self.token_to_request_idx,
            self.token_to_block_idx, self.token_to_position_in_request,
            self.token_to_local_position_within_kv_block, self.attn_block_table, block_table,
            query_lengths, kv_offsets, self.arena.device["attn_cu_query"], next_tokens,
            self.prompt_tokens, num_requests=step.active, num_decode=step.fed_from_pending,
            active_tokens=step.active_tokens, padded_tokens=step.padded_tokens,
            padded_requests=step.padded_requests, row_offset=paused, block_size=table.block_size,
            dummy_block=table.allocator.dummy_block_idx, backend=self.backend, check=False)
        for start, count in table.discard_writes:   # tokens recomputed in shared blocks
            self.token_to_block_idx[start:start + count] = table.allocator.dummy_block_idx

    def attention_metadata(self, step) -> SimpleNamespace:
        """The step's attention metadata: views of the arena's attention sections and the
        attention block table, cut to the padded requests (the views are cut once per count)."""
        n = step.padded_requests
        views = self._attn_views.get(n)
        if views is None:
            if len(self._attn_views) >= 64:
                self._attn_views.clear()
            device = self.arena.device
            views = self._attn_views[n] = dict(
                query_lengths=device["attn_query_lengths"][:n],
                cu_query_seq_lengths=device["attn_cu_query"][:n + 1],
                cu_kv_seq_lengths=device["attn_cu_kv"][:n + 1],
                kv_seq_lengths=device["attn_kv_lengths"][:n],
                block_table=self.attn_block_table[:n])
        meta = SimpleNamespace(**views, max_seqlen_q=step.max_seqlen_q,
                               max_seqlen_k=step.max_seqlen_k)
        meta.state_data = vars(meta).copy()
        return meta

    def end_step(self) -> None:
        self.h2d.advance()

    def apply_update(self, plan, table, new_tokens: torch.Tensor,
                     new_drafts: Optional[torch.Tensor] = None) -> None:
        """Upload the committed host rows with the row plan and apply it in one launch (and,
        with speculative steps, move the drafts as the rows: ``new_drafts [k, A]``)."""
        rows = plan.total
        arena = self.arena.host
        arena["plan_src"][:rows] = plan.origin[:rows]
        arena["plan_col"][:rows] = plan.append_col[:rows]
        arena["plan_block"][:rows] = plan.append_block[:rows]
        self.identity_plan_rows = 0
        self._compact(table, new_tokens, new_token_offset=plan.old_paused, rows=rows,
                      old_total=plan.old_total)
        if new_drafts is not None:
            self.spec.move_drafts(new_drafts, plan.old_paused, rows, plan.old_total,
                                  self.arena.device["plan_src"])

    def apply_decode(self, plan, appended, table, new_tokens: torch.Tensor,
                     new_drafts: Optional[torch.Tensor] = None) -> None:
        """``apply_update`` of a decode update (``update_plan.DecodePlan``): the identity row
        plan, but for the swaps and appended blocks of the rows that start a block
        (``appended``: ``RequestTable.commit_decode``'s ``(columns, blocks)`` of new rows
        ``[0, filled)``, or None), put back to the identity after the launch: a decode update with
        no row starting a block writes no plan at all."""
        rows = table.total
        arena = self.arena.host
        plan_src, plan_col, plan_block = arena["plan_src"], arena["plan_col"], arena["plan_block"]
        if self.identity_plan_rows != rows:
            plan_src[:rows] = self.row_numbers[:rows]
            plan_col[:rows] = self.no_append[:rows]
            plan_block[:rows] = self.no_append[:rows]
            self.identity_plan_rows = rows
        if appended is None:
            self._compact(table, new_tokens, new_token_offset=0, rows=rows, old_total=rows)
            if new_drafts is not None:   # rows in place: the drafts are the rows' next ones
                self.spec.drafts[:rows].copy_(new_drafts.t())
            return
        filled = appended[1].size
        swaps = plan.dst.size
        if swaps:
            plan_src[plan.dst] = plan.src
        plan_col[:filled], plan_block[:filled] = appended
        self._compact(table, new_tokens, new_token_offset=0, rows=rows, old_total=rows)
        if new_drafts is not None:
            self.spec.move_drafts(new_drafts, 0, rows, rows, self.arena.device["plan_src"])
        # The launch has read (on CUDA: the arena copy has staged) the plan: back to the
        # identity.
        if swaps:
            plan_src[plan.dst] = plan.dst
        plan_col[:filled] = -1
        plan_block[:filled] = -1

    def _compact(self, table, new_tokens: torch.Tensor, *, new_token_offset: int, rows: int,
                 old_total: int) -> None:
        """Upload the arena and launch ``compact_requests`` from the current buffers into the
        other ones, which become current."""
        self.arena.flush(self.h2d)
        dst, src = self.current ^ 1, self.current
        device = self.arena.device
        compact_requests(
            self.block_tables[dst], self.block_tables[src], self.next_tokens[dst],
            self.next_tokens[src], new_tokens, device["plan_src"], device["plan_col"],
            device["plan_block"], new_token_offset=new_token_offset, num_rows=rows,
            clear_rows=max(rows, self.rows_used[dst], old_total), backend=self.backend,
            check=False)
        self.rows_used[dst] = rows
        self.current = dst
        if self.host_table_written:
            # The host table (written through a view) was compacted by the commit; the kernel
            # compacted a stale device copy: take the host's rows.
            self.upload_block_table(table, max(rows, old_total))

    # ------------------------------------------------------------------ handed out
    def field_view(self, table, field: int) -> torch.Tensor:
        """One per-request field, int32 ``[max_requests]``: with host views a view of the host
        row (writes reach the host, which is authoritative, at once); else the device mirror
        (writes need ``pull_bookkeeping``)."""
        self.check_allocated()
        if self.host_views:
            return torch.from_numpy(table.rows[field])
        self.sync()
        return self.arena.device["req"][field]

    def block_table_view(self, table) -> torch.Tensor:
        """int32 ``[max_requests, max_kv_block_count]``: with host views the host table (the
        device mirror follows at the next step or update), else the device table."""
        self.check_allocated()
        if self.host_views:
            self.host_table_written = True
            return torch.from_numpy(table.block_table)
        self.flush_block_rows(table)
        return self.block_table

    def metadata_views(self, table) -> dict:
        """Per-label tensors ``[max_requests]`` of the request metadata (as ``field_view``)."""
        self.check_allocated()
        if self.host_views:
            return {label: torch.from_numpy(table.metadata[label])
                    for label in self.metadata_labels}
        self.sync()
        return {label: self.arena.device[f"meta:{label}"] for label in self.metadata_labels}

    def active_metadata_views(self, table) -> dict:
        """Megatron-Core 0.19's ``active_request_metadata``: per label, a host tensor view of
        the metadata from the first active row on (active rows first, as 0.19's pinned copy;
        no copy: writes reach the rows)."""
        self.check_allocated()
        return {label: torch.from_numpy(table.metadata[label][table.paused:])
                for label in self.metadata_labels}

    def pull_bookkeeping(self, table) -> None:
        """Copy the handed-out device mirrors (fields, metadata, block table) back into the
        host table, after writes by hand on the device (one copy of each; nothing with host
        views)."""
        self.check_allocated()
        if self.host_views:
            return
        if self.arena.dirty:
            raise RuntimeError(
                "pull_bookkeeping_from_device(): the host changed after the device tensors were "
                "last handed out (an add_request or update in between); write them by hand "
                "after the host's last change, then pull")
        self.flush_block_rows(table)
        table.rows[:] = self.arena.device["req"].cpu().numpy()
        for label in table.metadata_labels:
            table.metadata[label][:] = self.arena.device[f"meta:{label}"].cpu().numpy()
        table.block_table[:] = self.block_table.cpu().numpy()

    def paused_tokens(self, paused: int) -> Optional[torch.Tensor]:
        """The pending next input tokens of the ``paused`` paused rows (a view), or None."""
        return self.next_tokens[self.current][:paused] if paused else None

    def paused_drafts(self, paused: int) -> Optional[torch.Tensor]:
        """The drafts of the ``paused`` paused rows, ``[k, paused]`` (a view), or None."""
        return self.spec.drafts[:paused].t() if paused and self.spec is not None else None

    def write_paused_tokens(self, tokens: Optional[torch.Tensor], paused: int) -> None:
        """Write the pending tokens of the first ``len(tokens)`` of the ``paused`` paused rows;
        None (Megatron-Core's reset value) changes nothing."""
        if tokens is not None:
            self.check_allocated()
            check_paused_tokens(tokens, paused)
            self.next_tokens[self.current][:tokens.numel()].copy_(tokens)

    def permute_pending(self, dst: np.ndarray, src: np.ndarray,
                        next_tokens: Optional[torch.Tensor],
                        new_drafts: Optional[torch.Tensor] = None) -> None:
        """Rows ``dst`` take the pending next tokens of rows ``src`` (read before any write),
        here and in ``next_tokens`` (and the columns of ``new_drafts [k, rows]``) when given
        (Megatron's step-local tokens)."""
        self.arena.dirty = True
        pending = self.next_tokens[self.current]
        index_dst = torch.from_numpy(dst).to(pending.device)
        index_src = torch.from_numpy(src).to(pending.device)
        pending[index_dst] = pending[index_src]
        if self.spec is not None:
            self.spec.drafts[index_dst] = self.spec.drafts[index_src]
            self.spec.lags[index_dst] = self.spec.lags[index_src]
        if next_tokens is not None and next_tokens.data_ptr() != pending.data_ptr():
            next_tokens[index_dst.to(next_tokens.device)] = \
                next_tokens[index_src.to(next_tokens.device)]
        if new_drafts is not None:
            new_drafts[:, index_dst.to(new_drafts.device)] = \
                new_drafts[:, index_src.to(new_drafts.device)]
