"""Device state of the context: the arena, the staging ring, the block tables, the step's token
arrays, the KV buffer and the Mamba states, and the launches that update them.

The device mirrors the request table. ``begin_step`` uploads what changed (one arena copy, the
new block-table rows, the prompt tokens) and builds the step's per-token arrays in one
``step_metadata`` launch; ``apply_update`` applies an update plan's row permutation to the
double-buffered block tables and pending tokens in one ``compact_requests`` launch, and
``apply_decode`` does the same for a decode update (``update_plan.DecodePlan``). On a CPU device
the arena is the host memory itself: nothing is uploaded. Every buffer here is allocated by the
context and checked once, so the launches skip the launchers' checks (``check=False``); the
inputs a user hands in are checked at the context's edge. The views the launches and the
attention metadata take are cut once per row range and reused while it stays the same.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from dynctx.kernels.compaction import compact_requests
from dynctx.kernels.step_metadata import step_metadata

from ._fields import FIELD_KV_OFFSET, FIELD_QUERY, NUM_FIELDS
from .staging import HostArena, HostToDevice

TOKEN_ARRAYS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                "token_to_block_idx", "token_to_position_in_request",
                "token_to_local_position_within_kv_block")


class DeviceState:
    """Every device tensor of the context (allocated at once; dropped on suspend).

    Args:
        device, backend: where the tensors live and the resolved kernel backend.
        max_requests, max_tokens, max_kv_block_count: sizes.
        metadata_types: ``[(label, dtype, on_device)]`` of the request metadata.
        kv_shape, params_dtype: the KV (or MLA latent) buffer.
        layers: the ``sizing.LayerLayout`` (Mamba shapes for hybrids).
    """

    def __init__(self, *, device: torch.device, backend: str, max_requests: int,
                 max_tokens: int, max_kv_block_count: int, metadata_types: list,
                 kv_shape: tuple, params_dtype: torch.dtype, layers):
        R, T, C = max_requests, max_tokens, max_kv_block_count
        self.device, self.backend = device, backend
        self.hybrid = layers.is_hybrid_model
        sections = [("req", torch.int32, (NUM_FIELDS, R))]
        sections += [(f"meta:{label}", dtype, (R,)) for label, dtype, _ in metadata_types]
        sections += [("attn_query_lengths", torch.int32, (R,)),
                     ("attn_cu_query", torch.int32, (R + 1,)),
                     ("attn_cu_kv", torch.int32, (R + 1,)),
                     ("attn_kv_lengths", torch.int32, (R,)),
                     ("plan_src", torch.int32, (R,)),
                     ("plan_col", torch.int32, (R,)),
                     ("plan_block", torch.int32, (R,))]
        if self.hybrid:
            sections += [("mamba_decode_slots", torch.int32, (R,)),
                         ("mamba_prefill_slots", torch.int32, (R,)),
                         ("mamba_chunked_slot", torch.int32, (1,)),
                         ("mamba_cu_seqlens", torch.int32, (R + 1,)),
                         ("mamba_zero_slots", torch.int64, (R,))]
        self.arena = HostArena(sections, device)
        self.metadata_labels = [label for label, _, _ in metadata_types]
        capacity = self.arena.nbytes + 4 * R * C + 2 * 8 * T + 4096
        self.h2d = HostToDevice(device, capacity)
        self.block_tables = [torch.full((R, C), -1, dtype=torch.int32, device=device)
                             for _ in range(2)]
        self.next_tokens = [torch.zeros(R, dtype=torch.int64, device=device) for _ in range(2)]
        self.current = 0
        self.rows_used = [0, 0]
        # A CPU context hands out host views of the block table: once one was handed out, the
        # next step (or update) refreshes the device table from the host, then clears this.
        self.host_table_written = False
        self.attn_block_table = torch.full((R, C), -1, dtype=torch.int32, device=device)
        for name in TOKEN_ARRAYS:
            setattr(self, name, torch.zeros(T, dtype=torch.int64, device=device))
        self.prompt_tokens = torch.zeros(T, dtype=torch.int64, device=device)
        # Row numbers 0..R-1 and -1s: a decode update's identity plan, written from these.
        self.row_numbers = np.arange(R, dtype=np.int32)
        self.no_append = np.full(R, -1, dtype=np.int32)
        # Between updates, rows [0, identity_plan_rows) of the arena's plan hold the identity
        # plan (0: unknown).
        self.identity_plan_rows = 0
        self._step_views: dict = {}
        self._attn_views: dict = {}
        self.memory_buffer = torch.empty(kv_shape, dtype=params_dtype, device=device)
        self.mamba_conv_states = self.mamba_ssm_states = self.mamba_seq_idx = None
        self.host_seq_idx = None
        if self.hybrid:
            self.mamba_conv_states = torch.empty(
                (layers.num_mamba_layers, R, *layers.mamba_conv_states_shape),
                dtype=layers.mamba_conv_states_dtype, device=device)
            self.mamba_ssm_states = torch.empty(
                (layers.num_mamba_layers, R, *layers.mamba_ssm_states_shape),
                dtype=layers.mamba_ssm_states_dtype, device=device)
            self.mamba_seq_idx = torch.full((T,), -1, dtype=torch.int32, device=device)
            self.host_seq_idx = np.full(T, -1, dtype=np.int32)

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

    def begin_step(self, step, table, device_prompts: list) -> None:
        """Upload the step's host state and build its per-token arrays (one launch)."""
        self.arena.flush(self.h2d)
        if self.host_table_written:
            self.upload_block_table(table, table.total)
        else:
            self.flush_block_rows(table)
        num_prompt = step.prompt_tokens
        if num_prompt > 0:
            self.h2d.copy(self.prompt_tokens[:num_prompt], table.prompt[:num_prompt])
        for tensor, offset in device_prompts:
            self.prompt_tokens[offset:offset + tensor.numel()].copy_(tensor)
        P = step.paused
        block_table, query_lengths, kv_offsets, next_tokens = self.step_views(P, step.total)
        step_metadata(
            self.token_to_input_ids, self.token_to_pos_ids, self.token_to_request_idx,
            self.token_to_block_idx, self.token_to_position_in_request,
            self.token_to_local_position_within_kv_block, self.attn_block_table, block_table,
            query_lengths, kv_offsets, self.arena.device["attn_cu_query"], next_tokens,
            self.prompt_tokens, num_requests=step.active, num_decode=step.fed_from_pending,
            active_tokens=step.active_tokens, padded_tokens=step.padded_tokens,
            padded_requests=step.padded_requests, row_offset=P, block_size=table.block_size,
            dummy_block=table.allocator.dummy_block_idx, backend=self.backend, check=False)

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

    def mamba_step_fields(self, step) -> dict:
        """Zero the Mamba states of this step's new requests; the step's Mamba metadata fields
        (``MambaMetadata.STEP_FIELDS``) as views of the device state."""
        host, device = step.mamba, self.arena.device
        if host.zero_count:
            new_slots = device["mamba_zero_slots"][:host.zero_count]
            self.mamba_conv_states.index_fill_(1, new_slots, 0)
            self.mamba_ssm_states.index_fill_(1, new_slots, 0)
        padded_tokens = step.padded_tokens
        if host.padded_prefill:
            self.h2d.copy(self.mamba_seq_idx[:padded_tokens], self.host_seq_idx[:padded_tokens])
        return dict(
            batch_indices_decode=(device["mamba_decode_slots"][:host.padded_decode]
                                  if host.padded_decode else None),
            batch_indices_prefill=(device["mamba_prefill_slots"][:host.padded_prefill]
                                   if host.padded_prefill else None),
            batch_indices_chunked_prefill=(device["mamba_chunked_slot"]
                                           if host.chunked else None),
            cu_seqlens=(device["mamba_cu_seqlens"][:host.padded_prefill + 1]
                        if host.padded_prefill else None),
            seq_idx=(self.mamba_seq_idx[:padded_tokens].unsqueeze(0)
                     if host.padded_prefill else None),
            device_decode_prefill=(host.decode, host.regular),
            device_chunked_prefill=((host.regular_tokens, host.chunked_tokens)
                                    if host.chunked else None),
        )

    def end_step(self) -> None:
        self.h2d.advance()

    def apply_update(self, plan, table, new_tokens: torch.Tensor) -> None:
        """Upload the committed host rows with the row plan and apply it in one launch."""
        rows = plan.total
        arena = self.arena.host
        arena["plan_src"][:rows] = plan.origin[:rows]
        arena["plan_col"][:rows] = plan.append_col[:rows]
        arena["plan_block"][:rows] = plan.append_block[:rows]
        self.identity_plan_rows = 0
        self._compact(table, new_tokens, new_token_offset=plan.old_paused, rows=rows,
                      old_total=plan.old_total)

    def apply_decode(self, plan, appended, table, new_tokens: torch.Tensor) -> None:
        """``apply_update`` of a decode update (``update_plan.DecodePlan``): the identity row
        plan, but for the swaps and appended blocks of the rows that start a block
        (``appended``: ``RequestTable.commit_decode``'s ``(columns, blocks)`` of new rows
        ``[0, k)``, or None), put back to the identity after the launch: a decode update with
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
            return
        k = appended[1].size
        swaps = plan.dst.size
        if swaps:
            plan_src[plan.dst] = plan.src
        plan_col[:k], plan_block[:k] = appended
        self._compact(table, new_tokens, new_token_offset=0, rows=rows, old_total=rows)
        # The launch has read (on CUDA: the arena copy has staged) the plan: back to the
        # identity.
        if swaps:
            plan_src[plan.dst] = plan.dst
        plan_col[:k] = -1
        plan_block[:k] = -1

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
