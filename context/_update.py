"""The step-end state machine of the context (``update_requests``, docs/SEMANTICS.md §9).

Everything runs on the host over numpy rows (finish, compact, pause, resume LIFO, evict, the
chunked-request swap); the device gets the new rows in one arena upload and the row plan in one
``compact_requests`` launch.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from dynctx.kernels.compaction import compact_requests

from ._fields import (
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_QUERY,
)


class UpdateMixin:
    """``update_requests`` and its host-side steps, for ``DynamicInferenceContext``."""

    def _check_new_tokens(self, new_tokens: torch.Tensor, count: int) -> torch.Tensor:
        if not isinstance(new_tokens, torch.Tensor):
            raise TypeError(f"new_tokens must be a torch.Tensor, got {type(new_tokens).__name__}")
        if new_tokens.is_floating_point() or new_tokens.is_complex() or new_tokens.dtype == torch.bool:
            raise TypeError(f"new_tokens must hold integer token ids, got dtype {new_tokens.dtype}")
        if new_tokens.dim() != 1 or new_tokens.shape[0] != count:
            raise ValueError(f"new_tokens must have shape [{count}] (one per active request), got "
                             f"{tuple(new_tokens.shape)}")
        if new_tokens.device != self.device:
            raise ValueError(f"new_tokens is on {new_tokens.device}, the context on {self.device}")
        if self.validate and count:
            low, high = int(new_tokens.min()), int(new_tokens.max())
            limit = self.vocab_size
            if low < 0 or (limit is not None and high >= limit):
                raise ValueError(f"new_tokens holds ids in [{low}, {high}], outside [0, "
                                 f"{'inf' if limit is None else limit}) (vocab_size)")
        return new_tokens

    def _read_mask(self, mask: torch.Tensor, count: int) -> np.ndarray:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"active_requests_mask must be a torch.Tensor, got "
                            f"{type(mask).__name__}")
        if mask.dim() != 1 or mask.shape[0] != count:
            raise ValueError(f"active_requests_mask must have shape [{count}] (one per active "
                             f"request), got {tuple(mask.shape)}")
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(f"active_requests_mask must be bool or integer, got {mask.dtype}")
        if mask.device != self.device:
            raise ValueError(f"active_requests_mask is on {mask.device}, the context on "
                             f"{self.device}")
        host = mask.cpu().numpy()  # The step's one device-to-host read.
        if host.dtype != np.bool_:
            if np.any((host != 0) & (host != 1)):
                raise ValueError("active_requests_mask must hold only 0 and 1")
            host = host.astype(np.bool_)
        return host.copy()

    def _move_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Host ``x[dst] = x[src]`` for every per-request array (and the row origin map)."""
        self._h_req[:, dst] = self._h_req[:, src]
        self._h_bt[dst] = self._h_bt[src]
        for label, _, _ in self.request_metadata_types:
            meta = self._arena.host[f"meta:{label}"]
            meta[dst] = meta[src]
        self._origin[dst] = self._origin[src]

    def _release_rows(self, rows: np.ndarray) -> None:
        """Free the blocks (row-major order, as the reference pushes them) and the Mamba slots
        of ``rows``, and mark the rows free."""
        self.block_allocator.release_memory_blocks(self._h_bt[rows].reshape(-1))
        if self.is_hybrid_model:
            self._mamba_slots.release(self._h_req[FIELD_MAMBA_SLOT, rows])
        self._clear_rows(rows)

    def _clear_rows(self, rows: np.ndarray) -> None:
        """Mark rows free (their blocks and slots were released or moved elsewhere)."""
        self._h_bt[rows] = -1
        self._h_req[FIELD_IDS, rows] = -1
        self._h_req[FIELD_MAMBA_SLOT, rows] = -1

    def _resume(self, P: int, a: int) -> Tuple[int, int]:
        """Resume paused requests, right-most first (LIFO), each with one new block."""
        if P == 0:
            return P, a
        counts = self._h_req[FIELD_BLOCKS]
        avail_active = self.block_allocator.active_count - int(counts[P:P + a].sum())
        needs = counts[:P][::-1].astype(np.int64) + 1
        r = int(np.count_nonzero(np.cumsum(needs) <= avail_active))
        r = min(r, self.block_allocator.total_avail)
        if r == 0:
            return P, a
        rows = np.arange(P - r, P)
        blocks = self.block_allocator.allocate_memory_blocks(r)
        cols = counts[rows]
        self._h_bt[rows, cols] = blocks
        counts[rows] += 1
        self._h_req[FIELD_LAST_BLOCK, rows] = blocks
        return P - r, a + r

    def _evict(self, P: int, a: int) -> Tuple[int, np.ndarray]:
        """Evict paused requests from the right until paused blocks fit their budget."""
        counts = self._h_req[FIELD_BLOCKS, :P].astype(np.int64)
        budget = self.block_allocator.paused_count
        if P == 0 or counts.sum() <= budget:
            return P, np.empty(0, dtype=np.int64)
        overflow = P - int(np.count_nonzero(np.cumsum(counts) <= budget))
        if overflow == 0:
            return P, np.empty(0, dtype=np.int64)
        tail = counts[P - overflow:][::-1]
        net = np.cumsum(tail) - (overflow - 1 - np.arange(overflow))
        evict = int(np.flatnonzero(net >= 0)[0]) + 1
        rows = np.arange(P - evict, P)
        evicted = self._h_req[FIELD_IDS, rows].astype(np.int64)
        self._release_rows(rows)
        T = P + a
        if evict < a:
            left, right = rows, np.arange(T - evict, T)
        else:
            left, right = np.arange(P - evict, P - evict + a), np.arange(P, P + a)
        self._move_rows(np.concatenate([left, right]), np.concatenate([right, left]))
        self._clear_rows(np.arange(T - evict, T))
        return P - evict, evicted

    def update_requests(self, active_requests_mask: torch.Tensor,
                        new_tokens: torch.Tensor) -> torch.Tensor:
        """Advance the state after a forward pass (docs/SEMANTICS.md §9, with the §0 fixes).

        ``active_requests_mask[i]`` (bool/0-1, one per active request) keeps request i; 0
        finishes it. ``new_tokens`` (one per active request) is not modified. Finished requests
        release their blocks; requests whose last block is full pause, and paused requests
        resume (LIFO) or are evicted beyond the paused budget. Returns the ids (1-D int64 CPU
        tensor) of the requests this call paused that are still paused; the ids this call
        evicted are in ``self.evicted_request_ids`` (re-queue them for recompute). The one
        device-to-host read is the mask.
        """
        self._check_allocated()
        P, T = self.paused_request_count, self.total_request_count
        A, P_old = T - P, P
        self._check_new_tokens(new_tokens, A)
        mask = self._read_mask(active_requests_mask, A)
        chunked_id = self.chunked_prefill_request_id
        if chunked_id != -1 and A:
            mask[-1] = True
        self.num_prefill_requests = 0
        self.has_explicit_chunked_prefill_req = False
        self._continuation_added = False
        self.reset_attention_state()
        h = self._h_req
        old_counts = h[FIELD_BLOCKS, :T].copy()
        old_rows_used = T
        self._origin = np.full(self.max_requests, -1, dtype=np.int64)
        self._origin[:T] = np.arange(T)
        self.evicted_request_ids = torch.empty(0, dtype=torch.int64)
        a = int(mask.sum())
        finished_ids = h[FIELD_IDS, P:T][~mask]
        self._live_ids.difference_update(finished_ids.tolist())

        if a + P == 0:
            self._release_rows(np.arange(P, T))
            self.total_request_count = self.paused_request_count = 0
            self.active_token_count = 0
            self.newly_paused_request_ids = torch.empty(0, dtype=torch.int64)
            self._apply_plan(new_tokens, old_counts, P_old=P, rows=0, old_rows_used=old_rows_used)
            self._log_metrics()
            return self.newly_paused_request_ids

        finished_rows = P + np.flatnonzero(~mask)
        if finished_rows.size:
            self._release_rows(finished_rows)
            if a > 0:
                holes = P + np.flatnonzero(~mask[:a])
                movers = P + a + np.flatnonzero(mask[a:])
                if holes.size:
                    self._move_rows(holes, movers)
                    self._clear_rows(movers)
        T = P + a

        paused_now = np.empty(0, dtype=np.int64)
        if a > 0:
            need = h[FIELD_LAST_OFFSET, P:T] == self.block_size_tokens - 1
            if chunked_id != -1:
                need &= h[FIELD_IDS, P:T] != chunked_id
            k = int(need.sum())
            if k:
                paused_now = h[FIELD_IDS, P:T][need].astype(np.int64)
                if k < a:
                    left_keep = np.flatnonzero(~need[:k])
                    right_need = k + np.flatnonzero(need[k:])
                    self._move_rows(P + np.concatenate([left_keep, right_need]),
                                    P + np.concatenate([right_need, left_keep]))
                P, a = P + k, a - k

        P, a = self._resume(P, a)
        P, evicted = self._evict(P, a)
        P, a = self._resume(P, a)
        T = P + a
        if a == 0:
            raise RuntimeError(
                f"no request can run: {P} paused requests hold {self._paused_used_blocks()} "
                f"blocks and none can resume ({self.block_allocator.total_avail} free blocks, "
                f"active budget {self.block_allocator.active_count}); the buffer is too small "
                "for max_sequence_length")
        if chunked_id != -1:
            row = P + int(np.flatnonzero(h[FIELD_IDS, P:T] == chunked_id)[0])
            if row != T - 1:
                self._move_rows(np.array([row, T - 1]), np.array([T - 1, row]))

        # The next step is a pure decode unless requests are added.
        h[FIELD_KV_OFFSET, P:T] += h[FIELD_QUERY, P:T]
        h[FIELD_QUERY, P:T] = 1
        h[FIELD_LAST_OFFSET, P:T] = (h[FIELD_LAST_OFFSET, P:T] + 1) % self.block_size_tokens
        self.paused_request_count, self.total_request_count = P, T
        self.active_token_count = a
        self._live_ids.difference_update(evicted.tolist())
        still_paused = h[FIELD_IDS, :P].astype(np.int64)
        self.newly_paused_request_ids = torch.from_numpy(
            still_paused[np.isin(still_paused, paused_now)].copy())
        self.evicted_request_ids = torch.from_numpy(evicted)
        self._apply_plan(new_tokens, old_counts, P_old=P_old, rows=T,
                         old_rows_used=old_rows_used)
        self._log_metrics()
        return self.newly_paused_request_ids

    def _apply_plan(self, new_tokens: torch.Tensor, old_counts: np.ndarray, *, P_old: int,
                    rows: int, old_rows_used: int) -> None:
        """Upload the host state and apply the row plan to the device in one launch."""
        arena = self._arena.host
        origin = self._origin[:rows]
        src = arena["plan_src"]
        src[:rows] = origin
        counts = self._h_req[FIELD_BLOCKS, :rows]
        appended = counts > old_counts[origin]
        col = np.where(appended, counts - 1, -1)
        arena["plan_col"][:rows] = col
        arena["plan_block"][:rows] = np.where(
            appended, self._h_bt[np.arange(rows), np.maximum(col, 0)], -1)
        self._arena.flush(self._h2d)
        dst_index = self._current ^ 1
        device = self._arena.device
        compact_requests(
            self._block_tables[dst_index], self._block_tables[self._current],
            self._next_tokens[dst_index], self._next_tokens[self._current], new_tokens,
            device["plan_src"], device["plan_col"], device["plan_block"],
            new_token_offset=P_old, num_rows=rows,
            clear_rows=max(rows, self._rows_used[dst_index], old_rows_used),
            backend=self.kernel_backend)
        self._rows_used[dst_index] = rows
        self._current = dst_index
        self._bt_dirty_from = self.max_requests
