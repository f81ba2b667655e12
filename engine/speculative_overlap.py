"""Async scheduling with speculative steps: step n+1 is laid out and launched before step n's
accepted drafts are read (``Engine(..., async_scheduling=True)`` with a drafter;
docs/SEMANTICS.md §19, "Async scheduling").

``SpeculativeAsync`` is ``AsyncScheduling`` (``engine/overlap.py``) over a
``SpeculativeStepper``, with three differences:

* **The rewind is deferred.** Step n's accepted counts stay on the device: the context is told
  them there (``defer_kv_rewind``) and lowers each decode row's offsets when its next step
  begins, the host laying that step out as if every draft were accepted. When step n's tokens
  are read (during step n+1, after its forward pass was launched) the host applies the same
  rewinds (``settle_kv_rewind``) to the rows of step n+1 whose lag the device applied; a row
  paused in between is settled once it runs again.
* **Drafts guess one token further.** Step n+1's drafts are proposed before step n's tokens are
  known: the drafter sees the request's tokens as known, plus step n's drafts as if accepted,
  and proposes ``k + 1`` tokens, the first a guess of step n's own token, which is dropped. A
  wrong guess costs acceptance, never a different output: greedy verification keeps exactly the
  target's tokens. Sampled requests decode without drafts (a seeded draw needs its token index,
  known only when one token a step is in flight).
* **A step's tokens are a list per request** (the accepted drafts and the target's own),
  delivered one step late; the finish rules run over them in order, and a request that stops
  while its row is still in the context retires as without speculation.

Log probs of the gained tokens are read with them; a step in which a prefill asks for prompt log
probs reads them before its update, as without speculation.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

from .overlap import AsyncScheduling, PendingDelivery, PendingStep, TokenReadback
from .results import StepResult
from .sampling import REFUSED, finish_reason, is_greedy, upload
from .speculative_step import SpeculativeRow, read_log_probs
from .state import Row
from .step import REFUSED_ERROR


class SpeculativeAsync(AsyncScheduling):
    """The async mode over a ``SpeculativeStepper`` (module docstring)."""

    def __init__(self, steps: Any):
        super().__init__(steps)
        ctx, k = steps.context, steps.k
        self.k = k
        ctx.enable_deferred_rewind()   # before any graph captures the arena's views
        # The readout: next token, accepted count and k drafts a decode row, one a prefill.
        self.readback = TokenReadback(ctx.device, ctx.max_requests * (2 + k))
        self.log_prob_readback = TokenReadback(ctx.device, ctx.max_requests * (1 + k),
                                               torch.float32)
        # The drafts each request forwards in its next step (host copies of what the last
        # update gave it), and the rejected drafts the device applied but the host has not.
        self.proposed: Dict[int, List[int]] = {}
        self.unsettled: Dict[int, int] = {}
        self.gained: Dict[int, List[int]] = {}

    # ------------------------------------------------------------------ the step
    def step(self, result: StepResult) -> None:
        super().step(result)
        if self.gained:
            result.all_new_tokens.update(self.gained)
            self.steps.stats.generated_tokens += sum(len(t) - 1 for t in self.gained.values())
            self.gained = {}

    # ------------------------------------------------------------------ mask and update
    def outcomes(self, batch: Any) -> List[Row]:
        """Each row's mask decision from what the host knows now: a request whose step
        gains at least one token finishes by count when one more reaches its budget."""
        rows: List[Row] = []
        prompt_lists = None if batch.log_prob_lists is None else read_log_probs(
            batch.log_prob_lists, batch.prompt_layout, batch.num_decode, self.k)[1]
        for i, state in enumerate(batch.states):
            row = SpeculativeRow(state)
            rows.append(row)
            if state.request_id in self.retired:
                row.finish = "retired"
                continue
            if prompt_lists is not None and state.params.return_log_probs:
                row.prompt_log_probs = prompt_lists[i]
            if state.request_id == batch.chunked_id:
                continue
            if len(state.request.generated_tokens) + 1 >= state.params.num_tokens_to_generate:
                row.finish = "length"
        return rows

    def update(self, batch: Any, rows: List[Row], result: StepResult, handles: tuple) -> None:
        """Settle the rewinds the device applied at this step's start, propose the next
        drafts, defer this step's rewind, ``update_requests``; the deliveries wait."""
        steps = self.steps
        ctx = steps.context
        decode = batch.num_decode
        self._settle(batch)
        assumed = {}
        # A row near max_sequence_length gets no drafts: the host counts the step in flight's
        # drafts as accepted, and the context finishes a row whose count passes the limit.
        limit = ctx.max_sequence_length - 2 * (1 + self.k)
        for i, row in enumerate(rows):
            state = row.state
            if (row.keep and state.request_id != batch.chunked_id
                    and state.request_id not in self.retired and is_greedy(state.params)
                    and len(state.request.prompt_tokens) + len(state.request.generated_tokens)
                    < limit):
                assumed[state.request_id] = self.proposed.get(state.request_id, []) \
                    if i < decode else []
        drafts, counts = steps.next_drafts(rows, batch.chunked_id, assumed=assumed)
        if decode:
            accepted = torch.zeros(len(rows), dtype=torch.int64, device=batch.accepted.device)
            accepted[:decode] = batch.accepted
            ctx.defer_kv_rewind(accepted)
        mask = torch.tensor([r.keep for r in rows], dtype=torch.bool)
        paused = ctx.update_requests(mask, batch.sampled, upload(drafts, ctx.device),
                                     draft_counts=counts)
        for i, row in enumerate(rows):
            if row.keep:
                self.proposed[row.state.request_id] = drafts[:counts[i], i].tolist()
        paused_ids = [int(i) for i in paused.tolist()]
        evicted_ids = [int(i) for i in ctx.evicted_request_ids.tolist()]
        deliveries = []
        for i, row in enumerate(rows):
            request_id = row.state.request_id
            if row.finish == "retired":
                self._leave(request_id)
                self.release(request_id)
                continue
            row.state.prompt_log_probs.extend(row.prompt_log_probs)
            if request_id != batch.chunked_id:
                deliveries.append(PendingDelivery(
                    i, row.state, row.keep, int(batch.draft_counts[i]) if i < decode else -1))
            if not row.keep:
                self._leave(request_id)
        result.paused_ids = [rid for rid in paused_ids if rid not in self.retired]
        evicted_live = []
        for request_id in evicted_ids:
            self._leave(request_id)
            if not self.release(request_id):
                evicted_live.append(request_id)
            else:
                self.counts["retired_evicted"] += 1
        result.evicted_ids = evicted_live
        if evicted_live:
            steps.drafter.release(evicted_live)
        if deliveries:
            delivered = {d.state.request_id for d in deliveries}
            self.pending = PendingStep(step=steps.step_count, deliveries=deliveries,
                                       evicted=set(evicted_live) & delivered,
                                       paused=set(result.paused_ids) & delivered,
                                       handle=handles[0], delivered_ids=delivered,
                                       log_prob_handle=handles[1], num_decode=decode)
        steps.after_update(result)

    def _settle(self, batch: Any) -> None:
        """The host's side of the rewinds the device applied when this step began: the rows
        of this step's decode requests whose rejected drafts were read since."""
        ids = [state.request_id for state in batch.states[:batch.num_decode]
               if state.request_id in self.unsettled]
        if ids:
            self.steps.context.settle_kv_rewind(ids, [self.unsettled.pop(i) for i in ids])

    def _leave(self, request_id: int) -> None:
        """A row left the context: what was kept for it goes."""
        self.proposed.pop(request_id, None)
        self.unsettled.pop(request_id, None)

    def before_suspend(self) -> List[int]:
        """``AsyncScheduling.before_suspend``; the suspend then empties the context, so no
        row keeps a lag or drafts."""
        retired = super().before_suspend()
        self.proposed.clear()
        self.unsettled.clear()
        return retired

    # ------------------------------------------------------------------ reading
    def resolve(self, new_tokens: Dict[int, int]) -> None:
        """Read the pending step's readout: each request's gained tokens (cut at the first that
        finishes it), their log probs, and the rejected drafts its row's next step rewinds."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        steps, k = self.steps, self.k
        delivery = steps.delivery
        values = self.readback.read(pending.handle)
        log_probs = None if pending.log_prob_handle is None \
            else self.log_prob_readback.read(pending.log_prob_handle)
        decode = pending.num_decode
        nexts, accepted = values[:decode], values[decode:2 * decode]
        drafts = values[2 * decode:2 * decode + decode * k]
        prefill = values[2 * decode + decode * k:]
        lists = None if log_probs is None else read_log_probs(log_probs, None, decode, k)[0]
        now = time.perf_counter()
        counts = steps.counts
        counts.forward_steps += 1
        left = []
        for item in pending.deliveries:
            state, i = item.state, item.index
            request_id = state.request_id
            is_decode = i < decode
            token = nexts[i] if is_decode else prefill[i - decode]
            error, reason, gained = None, None, []
            if token == REFUSED:
                reason, error = "error", REFUSED_ERROR
            else:
                gained = (drafts[i * k:i * k + accepted[i]] if is_decode else []) + [token]
                generated = len(state.request.generated_tokens)
                for n, t in enumerate(gained):
                    generated += 1
                    if lists is not None and state.params.return_log_probs:
                        state.generated_log_probs.append(lists[i][n])
                    delivery.append_token(state, t, new_tokens, now, step=pending.step)
                    reason = finish_reason(state.params, t, generated)
                    if reason is not None:
                        gained = gained[:n + 1]
                        break
                self.gained[request_id] = gained
            if is_decode:
                counts.decode_rows += 1
                counts.draft_tokens += item.drafted
                counts.accepted_tokens += accepted[i]
                counts.emitted_tokens += len(gained)
                if item.kept and request_id not in pending.evicted and item.drafted > 0:
                    self.unsettled[request_id] = item.drafted - accepted[i]
            if reason is None:
                continue
            left.append(request_id)
            self.finish_or_retire(state, item.kept, reason, now, pending, error)
        steps.stats.speculative = counts.as_dict()
        if left:
            steps.drafter.release(left)
