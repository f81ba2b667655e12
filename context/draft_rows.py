"""The device side of speculative steps: each row's drafts, the step's logit rows, the tokens a
decode row forwards (docs/SEMANTICS.md §19).

``DraftRows`` belongs to the ``DeviceState`` of a context with ``num_speculative_tokens = k >
0`` (allocated and released with it). What it holds:

* ``drafts``, int64 ``[R, k]``: each row's pending drafts, moved with the rows by an update
  (``move_drafts``: paused rows keep theirs, the rows that were active take the update's
  ``new_speculative_tokens``), beside the pending tokens the compaction moves;
* ``logit_rows``: ``speculative_required_logit_indices`` of the step (``upload_logit_rows``);
* ``rewind_counts``: a rewind's rejected drafts per decode row (the Mamba restore's input);
* the scratch of a ragged step (decode rows with their own draft counts), whose tokens are
  gathered to their offsets in the prompt buffer (``write_row_tokens``);
* with a deferred rewind (async scheduling, ``deferred``): ``lags``, int64 ``[R]``, each row's
  rejected drafts the host has not applied yet, moved with the rows like the drafts and
  applied on the device when the row's next step begins (``apply_lags``: its KV offset and
  lengths lowered, a hybrid's Mamba states restored, one ``speculative_rewind`` launch).
"""

from __future__ import annotations

import numpy as np
import torch

from dynctx.kernels.speculative_rewind import speculative_rewind

from ._fields import FIELD_KV_OFFSET, FIELD_MAMBA_SLOT, FIELD_QUERY
from .speculative import logit_rows


class DraftRows:
    """Speculative steps' device tensors (module docstring) for ``rows`` request rows and
    ``tokens`` step tokens."""

    def __init__(self, k: int, rows: int, tokens: int, device: torch.device):
        self.k, self.rows, self.tokens, self.device = k, rows, tokens, device
        self.drafts = self.carried_drafts = self.logit_rows = self.logit_rows_host = None
        self.rewind_counts = self.row_tokens = self.token_source = None
        self.logit_rows_used = 0
        self.deferred = False
        self.lags = self.carried_lags = self.step_lags = None

    def nbytes(self) -> int:
        k, rows, tokens = self.k, self.rows, self.tokens
        return 8 * (2 * rows + 1) * k + 16 * tokens + 4 * rows + 8 * rows * (1 + k) + 24 * rows

    def allocate(self) -> None:
        k, rows, tokens, device = self.k, self.rows, self.tokens, self.device
        self.drafts = torch.zeros(rows, k, dtype=torch.int64, device=device)
        # Row `rows` stays 0: the drafts of a row without a source.
        self.carried_drafts = torch.zeros(rows + 1, k, dtype=torch.int64, device=device)
        self.logit_rows = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.logit_rows_host = np.zeros(tokens, dtype=np.int64)
        self.logit_rows_used = 0  # rows of logit_rows past which every entry is 0
        self.rewind_counts = torch.zeros(rows, dtype=torch.int32, device=device)
        # A ragged step's decode rows: their pending token and drafts, and each token's
        # place among them.
        self.row_tokens = torch.zeros(rows, 1 + k, dtype=torch.int64, device=device)
        self.token_source = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.lags = torch.zeros(rows, dtype=torch.int64, device=device)
        # Row `rows` stays 0: the lag of a row without a source.
        self.carried_lags = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.step_lags = torch.zeros(rows, dtype=torch.int64, device=device)

    def release(self) -> None:
        self.drafts = self.carried_drafts = self.logit_rows = self.logit_rows_host = None
        self.rewind_counts = self.row_tokens = self.token_source = None
        self.lags = self.carried_lags = self.step_lags = None

    # ------------------------------------------------------------------ a step
    def write_row_tokens(self, step, table, next_tokens: torch.Tensor,
                         prompt_tokens: torch.Tensor, cu_query: np.ndarray, h2d) -> None:
        """The drafted decode rows' tokens into the front of ``prompt_tokens``: the pending
        token (``next_tokens``, the active rows' view) then the row's drafts; a plain step's
        pending tokens alone; a ragged step's rows the first ``query - 1`` drafts each,
        gathered to their offsets (``cu_query``, the step's host cumulative query lengths:
        one upload of each token's source, one gather)."""
        drafted, paused, width = step.drafted, step.paused, 1 + self.k
        if step.decode_tokens == step.decode:   # a plain decode step: no row has drafts
            prompt_tokens[:drafted].copy_(next_tokens[:drafted])
            return
        if not step.ragged:
            row_tokens = prompt_tokens[:drafted * width].view(drafted, width)
        else:
            row_tokens = self.row_tokens[:drafted]
        row_tokens[:, 0].copy_(next_tokens[:drafted])
        row_tokens[:, 1:].copy_(self.drafts[paused:paused + drafted])
        if step.ragged:
            queries = table.rows[FIELD_QUERY, paused:paused + drafted].astype(np.int64)
            cu = cu_query[:drafted + 1].astype(np.int64)
            total = int(cu[-1])
            owner = np.repeat(np.arange(drafted), queries)
            h2d.copy(self.token_source[:total], owner * width + (np.arange(total) - cu[owner]))
            torch.index_select(self.row_tokens.view(-1), 0, self.token_source[:total],
                               out=prompt_tokens[:total])

    def upload_logit_rows(self, step, cu_query: np.ndarray, count: int, h2d) -> None:
        """``speculative_required_logit_indices`` of ``step`` (``count`` rows,
        ``speculative.logit_rows``) into ``logit_rows``, zero past them (0.19's
        ``active_logit_idxs``), one upload."""
        upto, self.logit_rows_used = max(count, self.logit_rows_used), count
        if upto:
            logit_rows(step.decode, step.prefill, self.k, cu_query, self.logit_rows_host,
                       step.active_tokens, step.padded_tokens, count)
            self.logit_rows_host[count:upto] = 0
            h2d.copy(self.logit_rows[:upto], self.logit_rows_host[:upto])

    # ------------------------------------------------------------------ an update
    def move_drafts(self, new_drafts: torch.Tensor, paused: int, rows: int, old_total: int,
                    plan_src: torch.Tensor) -> None:
        """Rows ``[0, rows)`` take the drafts of their source row (``plan_src``, the plan the
        compaction read): paused rows keep theirs, the rows that were active take
        ``new_drafts`` ``[k, A]`` (0.19's ``cat(paused_speculative_tokens,
        new_speculative_tokens)``); rows after them are cleared."""
        carried = self.carried_drafts
        if paused:
            carried[:paused].copy_(self.drafts[:paused])
        carried[paused:paused + new_drafts.shape[1]].copy_(new_drafts.t())
        if rows:
            torch.index_select(carried, 0, plan_src[:rows], out=self.drafts[:rows])
        if old_total > rows:
            self.drafts[rows:old_total].zero_()
        if self.deferred:
            # The lags travel the same way: the rows that were active take this step's.
            lags = self.carried_lags
            if paused:
                lags[:paused].copy_(self.lags[:paused])
            lags[paused:paused + new_drafts.shape[1]].copy_(
                self.step_lags[:new_drafts.shape[1]])
            if rows:
                torch.index_select(lags, 0, plan_src[:rows], out=self.lags[:rows])
            if old_total > rows:
                self.lags[rows:old_total].zero_()

    # ------------------------------------------------------------------ a deferred rewind
    def record_lags(self, accepted: torch.Tensor, query_lengths: torch.Tensor, drafted: int,
                    active: int) -> None:
        """This step's rejected drafts per active row (``step_lags``), on the device: a
        drafted decode row's ``query - 1 - accepted``, 0 for the other rows."""
        lags = self.step_lags[:active]
        lags.zero_()
        if drafted:
            torch.sub(query_lengths[:drafted].long() - 1, accepted[:drafted].long(),
                      out=lags[:drafted])

    def apply_lags(self, step, arena: dict, mamba: tuple, backend: str) -> None:
        """The active rows' lags on the device, after the arena's upload and before the step's
        per-token arrays: their KV offsets and lengths lowered (the cumulative lengths of
        every row after them too) and a hybrid's Mamba states restored (``mamba``: ``(conv,
        ssm, conv intermediate, ssm intermediate)``, or ``()``), one launch; this step's lags
        start at zero."""
        paused, total, active = step.paused, step.total, step.active
        states = dict(zip(("conv_states", "ssm_states", "conv_intermediate",
                           "ssm_intermediate"), mamba))
        if states:
            states["slot_ids"] = arena["req"][FIELD_MAMBA_SLOT, paused:total]
        speculative_rewind(self.lags[paused:total],
                           kv_offsets=arena["req"][FIELD_KV_OFFSET, paused:total],
                           kv_lengths=arena["attn_kv_lengths"][:active],
                           cu_kv=arena["attn_cu_kv"][:step.padded_requests + 1],
                           backend=backend, check=False, **states)
        self.step_lags[:active].zero_()
