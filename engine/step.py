"""The step: admission, the model's forward, sampling, the finish mask and ``update_requests``.

``Stepper`` owns the pieces of an engine step and runs the synchronous step with them
(docs/SEMANTICS.md §10, §11): admit requests (arrivals, FIFO admission, chunked prefill:
``engine/scheduler.py``); ``initialize_attention_state``; the model's forward (or a captured
graph's replay, ``engine/graphs.py``); per-request sampling; the finish mask, built on the host;
``update_requests``; the evicted requests re-queued at the front for recompute. The step reads
the device once: the sampled tokens, with the rows sampling refused folded in
(``engine/sampling.py``). Async scheduling (``engine/overlap.py``) runs the same pieces in
another order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from dynctx.context import DynamicInferenceContext

from .intake import Intake
from .results import Delivery, EngineStats, StepResult
from .sampling import REFUSED, finish_reason, sample_checked
from .scheduler import Admission, Scheduler
from .state import RequestState, Row

# The error of a request whose logits gave sampling no distribution to draw from.
REFUSED_ERROR = ("sampling refused the request: its logits hold NaN, are all -inf, or hold "
                 "+inf under temperature sampling (no finite probabilities); build the context "
                 "with validate=True to check every token's logits")


@dataclass
class Batch:
    """One forward step: the active rows in order, the sampled tokens (``sampled`` on the
    device, valid ids; ``readout`` the same with ``REFUSED`` where sampling refused the row;
    ``tokens``, the readout on the host, empty under async scheduling), the rows whose logits
    failed the context's check, and the log probs when asked."""

    states: List[RequestState]
    num_decode: int
    chunked_id: int
    sampled: torch.Tensor
    readout: torch.Tensor
    tokens: List[int]
    failed: Dict[int, str]
    want_prompt_log_probs: bool
    log_prob_lists: Optional[List[List[float]]] = None
    full_log_probs: Optional[torch.Tensor] = None
    # Async scheduling, a step without prompt log probs: the sampled tokens' log probs on the
    # device, read with the tokens (engine/overlap.py).
    deferred_log_probs: Optional[torch.Tensor] = None


class Stepper:
    """The pieces of an engine step over one model and one context, and the synchronous step.

    ``step_count`` is the engine's step clock. ``model`` and ``graph_runner`` may be replaced
    between steps (the engine's attributes of the same names set them).
    """

    def __init__(self, *, model: Any, context: DynamicInferenceContext, scheduler: Scheduler,
                 intake: Intake, delivery: Delivery, stats: EngineStats,
                 rng: np.random.Generator, record_logits: bool):
        self.model = model
        self.context = context
        self.scheduler = scheduler
        self.intake = intake
        self.delivery = delivery
        self.stats = stats
        self.rng = rng
        self.record_logits = record_logits
        self.graph_runner: Any = None
        self.step_count = 0

    # ------------------------------------------------------------------ the synchronous step
    def step(self, result: StepResult) -> None:
        """Admit, then run a forward step (or skip ahead when nothing can run)."""
        self.admit()
        if self.context.active_token_count == 0:
            self.idle(result)
            return
        batch = self.forward(result)
        self.update(batch, self.outcomes(batch), result)

    def outcomes(self, batch: Batch) -> List[Row]:
        """Each active row's token, finish and log probs; changes nothing."""
        rows: List[Row] = []
        cache: Dict[str, Any] = {}
        for i, (state, token) in enumerate(zip(batch.states, batch.tokens)):
            row = Row(state)
            rows.append(row)
            if i in batch.failed:
                row.finish, row.error = "error", batch.failed[i]
                continue
            if state.request_id == batch.chunked_id:
                self.row_log_probs(row, i, batch, cache)
                continue  # a non-final chunk: its sample is junk, the context keeps it
            if token == REFUSED:
                row.finish, row.error = "error", REFUSED_ERROR
                continue
            self.row_log_probs(row, i, batch, cache)
            row.token = token
            row.finish = finish_reason(state.params, token,
                                       len(state.request.generated_tokens) + 1)
        return rows

    def update(self, batch: Batch, rows: List[Row], result: StepResult) -> None:
        """``update_requests`` with the rows' mask (on the host: the context reads it without
        waiting for the device), then the rows applied to the engine."""
        ctx = self.context
        if batch.chunked_id != -1 and any(row.finish == "error" and row.state.request_id ==
                                          batch.chunked_id for row in rows):
            # A chunked prefill that failed ends now: the mask releases it like any other.
            ctx.chunked_prefill_request_id = -1
            self.scheduler.discard(batch.chunked_id)
        mask = torch.from_numpy(np.fromiter((row.keep for row in rows), dtype=np.bool_,
                                            count=len(rows)))
        paused = ctx.update_requests(mask, batch.sampled)
        result.paused_ids = [int(i) for i in paused.tolist()]
        result.evicted_ids = [int(i) for i in ctx.evicted_request_ids.tolist()]
        now = time.perf_counter()
        for row in rows:
            self.delivery.apply(row, result, now, step=self.step_count)
        self.after_update(result)

    # ------------------------------------------------------------------ the shared pieces
    def admit(self) -> Any:
        """Release arrivals and schedule; refused requests finish with an error. Returns the
        ``Schedule`` (the admissions in order)."""
        now = time.perf_counter()
        states = self.intake.states
        for request_id in self.scheduler.release(self.step_count):
            states[request_id].arrival_time = now
        schedule = self.scheduler.schedule(self.intake.live_request)
        for admission in schedule.admitted:
            self._note_admission(admission)
        for request_id, error in schedule.refused:
            self.delivery.finish(states[request_id], "error", now, step=self.step_count,
                                 error=f"the context refused the request: {error}")
        return schedule

    def _note_admission(self, admission: Admission) -> None:
        state = self.intake.states[admission.request_id]
        if state.first_scheduled_step is None:
            state.first_scheduled_step = self.step_count
        if admission.continuation or not admission.final:
            state.num_prefill_chunks += 1
            self.stats.prefill_chunks += 1
            if not admission.continuation:
                self.stats.chunked_prefills += 1

    def idle(self, result: StepResult) -> None:
        """No request can run: skip ahead to the next arrival. A waiting request that the
        scheduler cannot add even to an empty context (none should be: the checks at
        submission and the scheduler's chunking cover every case known) finishes with an
        error, so that the others go on."""
        if self.scheduler.waiting:
            request_id = self.scheduler.waiting[0]
            request = self.intake.live_request(request_id)
            self.scheduler.discard(request_id)
            self.delivery.finish(
                self.intake.states[request_id], "error", time.perf_counter(),
                step=self.step_count, error=(
                    f"the scheduler cannot add the request even to an empty context "
                    f"({request.remaining_prompt_length} prompt tokens to compute, max_tokens="
                    f"{self.context.max_tokens}, check_availability="
                    f"{tuple(self.context.check_availability(request))}, "
                    f"enable_chunked_prefill={self.scheduler.enable_chunked_prefill}); please "
                    "report it"))
        result.idle = True
        self.stats.idle_steps += 1
        next_arrival = self.scheduler.next_arrival_step
        self.step_count = max(self.step_count + 1, next_arrival or 0)

    def forward(self, result: StepResult, in_flight: Any = None) -> Batch:
        """``initialize_attention_state``, the model's forward, the logits check, sampling and
        the log probs asked for.

        ``in_flight``: async scheduling's view of the rows (``engine/overlap.py``):
        ``params_for(state)``, the sampling parameters of a row; ``token_index(state)``, the
        tokens it generated before this sample, the one in flight counted; and
        ``device_log_probs(last, sampled)``, the sampled tokens' log probs kept on the device.
        The sampled tokens then stay on the device (``batch.tokens`` empty)."""
        ctx = self.context
        ctx.initialize_attention_state()
        paused, total = ctx.paused_request_count, ctx.total_request_count
        states = [self.intake.state(int(i)) for i in ctx.host_request_ids()[paused:total]]
        num_decode = ctx.num_decode_requests
        result.active_requests, result.paused_requests = total - paused, paused
        result.tokens = ctx.active_token_count
        result.kv_utilization = ctx.get_kvcache_utilization_stats()["allocated_utilization"]
        want_prompt_lp = any(state.wants_prompt_log_probs for state in states[num_decode:])
        # Every token's logits also when the context checks logits (vocab_size, validate): the
        # model's last-token path picks hidden-state rows through ``last_token_logits``, whose
        # checks are meant for logits.
        full = want_prompt_lp or self.checks_logits()
        forward_start = time.perf_counter()
        output, last, failed = self.run_model(full, len(states))
        params, indices = self.sampling_inputs(states, in_flight)
        sampled, readout = sample_checked(last, params, indices, self.rng)
        batch = Batch(states=states, num_decode=num_decode,
                      chunked_id=ctx.chunked_prefill_request_id, sampled=sampled,
                      readout=readout, tokens=readout.tolist() if in_flight is None else [],
                      failed=failed, want_prompt_log_probs=want_prompt_lp)
        if any(state.params.return_log_probs for state in states):
            if want_prompt_lp:
                batch.log_prob_lists, batch.full_log_probs = ctx.calculate_log_probs(
                    output, sampled)
            elif in_flight is not None:
                batch.deferred_log_probs = in_flight.device_log_probs(last, sampled)
            else:
                batch.log_prob_lists, batch.full_log_probs = ctx.calculate_log_probs(
                    last, sampled, only_last_token_logits=True)
        if self.record_logits:
            prefix = ctx.active_attn_metadata.kv_seq_lengths[:total - paused].tolist()
            rows = last.float().cpu()
            for i, state in enumerate(states):
                state.step_logits.append((int(prefix[i]), rows[i].clone()))
        self.stats.forward_time_s += time.perf_counter() - forward_start
        return batch

    def checks_logits(self) -> bool:
        """The context checks logits (``vocab_size`` or ``validate``): the model then gives
        every token's logits."""
        ctx = self.context
        return getattr(ctx, "vocab_size", None) is not None or bool(getattr(ctx, "validate", False))

    def run_model(self, full: bool, active: int) -> tuple:
        """The step's forward (the graph runner's replay, else the model's), ``full``: every
        token's logits: ``(output, last-token logits [rows, V], failed rows)``; the ``active``
        rows whose logits are not finite are failed (``_nonfinite_rows``) and zeroed."""
        ctx = self.context
        if self.graph_runner is not None:
            output = self.graph_runner.run(last_token_only=not full)
        else:
            output = self.model.forward(ctx, last_token_only=not full)
        failed = self._nonfinite_rows(output, full, active)
        if failed:
            # The failed rows finish with an error; zeros keep NaN out of sampling.
            output = torch.nan_to_num(output, nan=0.0, posinf=0.0, neginf=float("-inf"))
        return output, (ctx.last_token_logits(output) if full else output), failed

    @staticmethod
    def sampling_inputs(states: List[Any], in_flight: Any) -> tuple:
        """Each row's sampling params and the index of the token it samples: the requests'
        own, or under async scheduling those of the step in flight (``in_flight``)."""
        if in_flight is None:
            return ([state.params for state in states],
                    [len(state.request.generated_tokens) for state in states])
        return ([in_flight.params_for(state) for state in states],
                [in_flight.token_index(state) for state in states])

    def _nonfinite_rows(self, output: torch.Tensor, full: bool, active: int) -> Dict[int, str]:
        """With the context's ``validate``: the active rows whose logits hold NaN or +inf
        (-inf is legal: it masks a token), every token of a prefill counted."""
        ctx = self.context
        if not getattr(ctx, "validate", False) or active == 0:
            return {}
        if full:
            tokens = output.reshape(-1, output.shape[-1])[:ctx.active_token_count]
            bad_tokens = (tokens.isnan() | tokens.isposinf()).any(dim=-1)
            if not bool(bad_tokens.any()):
                return {}
            cu = ctx.active_attn_metadata.cu_query_seq_lengths[:active + 1].long()
            owner = torch.repeat_interleave(torch.arange(active, device=cu.device), cu.diff())
            rows = sorted(set(owner[bad_tokens.to(owner.device)].tolist()))
        else:
            rows = (output.isnan() | output.isposinf()).any(dim=-1).nonzero().flatten().tolist()
        return {int(row): "the model's logits hold NaN or +inf (checked with validate=True)"
                for row in rows}

    def row_log_probs(self, row: Row, i: int, batch: Batch, cache: Dict[str, Any]) -> None:
        """Row ``i``'s prompt and generated log probs, when its request asks for them
        (``cache`` keeps the step's ``cu_query_seq_lengths`` once read)."""
        state = row.state
        if batch.log_prob_lists is None or not state.params.return_log_probs:
            return
        is_chunk = state.request_id == batch.chunked_id
        values = batch.log_prob_lists[i]
        if state.wants_prompt_log_probs and i >= batch.num_decode and batch.want_prompt_log_probs:
            row.prompt_log_probs = list(values[:-1])
            if is_chunk:
                # The chunk's last position predicts the next chunk's first token.
                if "cu_query" not in cache:
                    cache["cu_query"] = self.context.active_attn_metadata \
                        .cu_query_seq_lengths.tolist()
                cu_query = cache["cu_query"]
                next_token = int(state.live.remaining_prompt_tokens[0])
                row.prompt_log_probs.append(
                    float(batch.full_log_probs[cu_query[i + 1] - 1, next_token]))
        if not is_chunk:
            row.generated_log_prob = values[-1]

    def after_update(self, result: StepResult) -> None:
        """The engine's side of an update whose ``result.paused_ids`` and
        ``result.evicted_ids`` are set: pause and eviction counts, the evicted requests
        re-queued for recompute, the step counted and closed."""
        states = self.intake.states
        for request_id in result.paused_ids:
            states[request_id].num_pauses += 1
        for request_id in result.evicted_ids:
            state = states[request_id]
            state.live, state.recompute = None, True
            state.num_evictions += 1
        self.scheduler.after_update(result.evicted_ids)
        self.delivery.count(result, self.context)
        self.step_count += 1
