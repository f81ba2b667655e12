"""Async scheduling: step n+1's host work runs while the device computes step n, the sampled
tokens stay on the device until the next step's forward is launched (``Engine(...,
async_scheduling=True)``; docs/DESIGN.md, "Async scheduling").

One engine step ``n`` in this mode:

1. admit requests and ``initialize_attention_state``; launch step n's forward and sampling.
   The sampled tokens stay on the device; a copy to the host starts (``TokenReadback``: on CUDA
   a non-blocking copy into pinned memory and an event; on a CPU the same calls, synchronous);
2. read step n-1's tokens (their copy is complete or nearly so: the device is busy with step
   n's forward), append them to their requests, detect termination ids and lengths, and
   deliver the finished results (``StepResult.new_tokens`` and ``finished`` of step n are step
   n-1's tokens and finishes: one step late);
3. ``update_requests`` of step n with a mask the host knows without step n's tokens (a request
   that reaches ``num_tokens_to_generate`` with step n's token by count; a request whose step
   n-1 token was its termination id) and ``new_tokens`` = the device tensor, which the
   context's compaction consumes on the device.

A request whose step n token is its termination id is found only in step n+1, after step
n+1's forward: it ran that step too, its step n+1 token is discarded (never delivered), and the
mask of update n+1 releases it. Between the two the engine holds it as a *retired* request: its
tokens streamed, its row still in the context; its result is delivered once an update releases
the row (masked, or evicted; a row paused by update n waits until it runs again), so that, as in
the synchronous engine, a delivered request has left the context and its id is free. A retired
row samples greedily (no draw from the engine's generator). The extra step is what vLLM's
async scheduler (placeholder outputs, a stale output dropped), SGLang's overlap scheduler (a
batch's results processed after the next batch is launched) and Megatron-Core 0.19's async
scheduling (``prepare_requests`` / ``commit_sampled_tokens`` / ``resolve_requests``) pay as
well.

When step n+1's host work needs step n's tokens, they are read before it (a sync, where the
synchronous engine has one every step): a request evicted by update n, whose recompute
checkpoint holds every generated token, is re-admitted only once its step n token is read;
``suspend()`` reads them first too. The sampled tokens' log probs travel with them (a second
readback); prompt log probs are read before the update, as in the synchronous engine (that
step does not overlap). A row whose logits gave sampling no distribution (``REFUSED`` in the
tokens read, ``engine/sampling.py``) is found when its token is read, and finishes as an error
the way a stopping request does (retired while its row is in the context).

``AsyncScheduling`` runs the pieces of ``engine/step.py``'s ``Stepper`` in this order and
finishes requests through the same ``Delivery`` (``engine/results.py``) as the synchronous
step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

import torch

from dynctx.context import SamplingParams
from dynctx.kernels import token_log_probs
from dynctx.kernels.devices import indexed_device

from .results import StepResult
from .sampling import REFUSED, finish_reason
from .state import RequestState, Row
from .step import REFUSED_ERROR, Batch, Stepper

# A retired row's junk token is sampled greedily: no draw from the engine's generator.
RETIRED_PARAMS = SamplingParams(temperature=0.0, top_k=1)


def refuse_conflicts(*, context: Any, record_logits: bool) -> None:
    """The options that need the sampled tokens or the logits on the host before the next
    step's forward: each raises ``ValueError`` naming it."""
    if getattr(context, "validate", False):
        raise ValueError(
            "async_scheduling=True conflicts with the context's validate=True: validate reads "
            "every step's logits (the NaN/+inf check) and new_tokens (their min and max) on the "
            "host before update_requests, the very sync async scheduling removes; build the "
            "context with validate=False, or use async_scheduling=False")
    if record_logits:
        raise ValueError(
            "async_scheduling=True conflicts with record_logits=True: recording copies every "
            "step's logits to the host before the update (a sync each step); use one or the "
            "other")


@dataclass(eq=False)
class Readback:
    """A copy on its way to the host: the buffer it fills, its event (CUDA), its length."""

    buffer: int
    event: Any
    count: int


class TokenReadback:
    """A step's sampled tokens (or any 1-D ``dtype`` tensor of at most ``capacity`` values, such
    as their log probs) on their way to the host.

    ``start(tokens)`` copies them into one of two host buffers (pinned on CUDA, where the copy
    does not block and an event is recorded behind it on the current stream) and returns the
    copy's ``Readback``. ``read(readback)`` waits for that event only (not for the whole
    device) and returns the values as Python numbers. A buffer is taken by ``start`` and
    freed when its copy is read (or ``discard``-ed, for a copy that will never be read): step
    n+1's copy starts before step n's is read, so the two alternate, and a copy never read
    cannot be overwritten by a later ``start`` (that raises instead).
    """

    def __init__(self, device: torch.device, capacity: int, dtype: torch.dtype = torch.int64):
        self.device = indexed_device(device)
        pinned = self.device.type == "cuda"
        self._buffers = [torch.empty(max(1, capacity), dtype=dtype, pin_memory=pinned)
                         for _ in range(2)]
        self._holders: List[Optional[Readback]] = [None, None]
        self.reads = 0

    def start(self, tokens: torch.Tensor) -> Readback:
        count = int(tokens.shape[0])
        capacity = self._buffers[0].shape[0]
        if count > capacity:
            raise RuntimeError(f"internal: {count} sampled tokens exceed the readback buffer "
                               f"of {capacity}")
        free = [i for i, holder in enumerate(self._holders) if holder is None]
        if not free:
            raise RuntimeError("internal: both readback buffers hold copies not read yet; "
                               "read or discard one before starting another")
        index = free[0]
        self._buffers[index][:count].copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        handle = self._holders[index] = Readback(index, event, count)
        return handle

    def read(self, handle: Readback) -> list:
        self._check_holds(handle)
        if handle.event is not None:
            handle.event.synchronize()
        values = self._buffers[handle.buffer][:handle.count].tolist()
        self._holders[handle.buffer] = None
        self.reads += 1
        return values

    def discard(self, handle: Optional[Readback]) -> None:
        """A copy that will not be read: its buffer is free again (None: nothing)."""
        if handle is not None and self._holders[handle.buffer] is handle:
            self._holders[handle.buffer] = None

    def _check_holds(self, handle: Readback) -> None:
        if self._holders[handle.buffer] is not handle:
            raise RuntimeError("internal: this readback was already read or discarded")


@dataclass
class PendingDelivery:
    """A row of step n whose token will be delivered: its index among the step's active
    rows, its state, and whether update n kept it in the context."""

    index: int
    state: RequestState
    kept: bool
    drafted: int = -1   # speculative steps: the drafts a decode row forwarded (-1: not one)


@dataclass
class PendingStep:
    """Step n, sampled and updated, its tokens not read yet."""

    step: int
    deliveries: List[PendingDelivery]
    evicted: Set[int]
    paused: Set[int]
    handle: Readback
    delivered_ids: Set[int]
    log_prob_handle: Optional[Readback] = None
    num_decode: int = 0   # speculative steps: the decode rows of the readout


class AsyncScheduling:
    """The async mode over a ``Stepper``: the step whose tokens are in flight and the retired
    requests (finished and delivered, their rows still in the context until the next
    update)."""

    def __init__(self, steps: Stepper):
        self.steps = steps
        ctx = steps.context
        self.readback = TokenReadback(ctx.device, ctx.max_requests)
        self.log_prob_readback = TokenReadback(ctx.device, ctx.max_requests, torch.float32)
        self.pending: Optional[PendingStep] = None
        self.retired: Dict[int, RequestState] = {}
        # A retired request's finish (reason, time, step, error), applied when its row is
        # released.
        self._retired_finish: Dict[int, tuple] = {}
        # Tokens read outside a step (by ``suspend``): reported with the next step.
        self.carried_tokens: Dict[int, int] = {}
        # How often each case came up: ``early_reads`` (tokens read before the admission, for
        # an evicted row), ``retired`` (requests that ran one step past their termination id),
        # ``retired_paused`` (of those, paused when their token was read),
        # ``retired_evicted`` (retired rows evicted instead of masked), ``evicted_stops``
        # (evicted rows whose token was their termination id: dropped from the queue).
        self.counts: Dict[str, int] = dict(early_reads=0, retired=0, retired_paused=0,
                                           retired_evicted=0, evicted_stops=0)

    def has_work(self) -> bool:
        """Tokens in flight or carried: a step still has something to deliver."""
        return self.pending is not None or bool(self.carried_tokens)

    # ------------------------------------------------------------------ the step
    def step(self, result: StepResult) -> None:
        steps = self.steps
        if self.carried_tokens:
            result.new_tokens.update(self.carried_tokens)
            self.carried_tokens = {}
        if self.pending is not None and self.pending.evicted:
            self.counts["early_reads"] += 1
            self.resolve(result.new_tokens)  # the recompute checkpoints need the tokens
        steps.admit()
        if steps.context.active_token_count == 0:
            # Nothing to run: the last step's tokens are read now (a flush).
            self.resolve(result.new_tokens)
            steps.stats.generated_tokens += len(result.new_tokens)
            steps.idle(result)
            return
        batch = steps.forward(result, self)
        handles = (self.readback.start(batch.readout),
                   None if batch.deferred_log_probs is None
                   else self.log_prob_readback.start(batch.deferred_log_probs))
        try:
            if self.pending is not None:
                self.resolve(result.new_tokens)
            self.update(batch, self.outcomes(batch), result, handles)
        finally:
            if self.pending is None or self.pending.handle is not handles[0]:
                # No delivery waits for this step's copies (or the step raised): free them.
                self.readback.discard(handles[0])
                self.log_prob_readback.discard(handles[1])

    # ------------------------------------------------------------------ the forward's view
    def params_for(self, state: RequestState) -> SamplingParams:
        """The sampling parameters of a row in this step's forward."""
        return RETIRED_PARAMS if state.request_id in self.retired else state.params

    def token_index(self, state: RequestState) -> int:
        """How many tokens the request has generated before this step's sample, counting its
        token still in flight (a seeded draw depends on it: engine/sampling.py)."""
        generated = len(state.request.generated_tokens)
        pending = self.pending
        if pending is not None and state.request_id in pending.delivered_ids:
            generated += 1
        return generated

    def device_log_probs(self, last: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """The log probs of the sampled tokens, on the device (read with the tokens): a step
        without prompt log probs needs no host read for them."""
        ctx = self.steps.context
        return token_log_probs(last, sampled, backend=ctx.kernel_backend)[0]

    # ------------------------------------------------------------------ mask and update
    def outcomes(self, batch: Batch) -> List[Row]:
        """Each row's mask decision from what the host knows now; log probs (read by the
        forward) recorded as the synchronous engine does. Retired rows are dropped."""
        rows: List[Row] = []
        cache: Dict[str, Any] = {}
        for i, state in enumerate(batch.states):
            row = Row(state)
            rows.append(row)
            if state.request_id in self.retired:
                row.finish = "retired"
                continue
            self.steps.row_log_probs(row, i, batch, cache)
            if state.request_id == batch.chunked_id:
                continue  # a non-final chunk: its sample is junk, the context keeps it
            generated = len(state.request.generated_tokens) + 1
            if generated >= state.params.num_tokens_to_generate:
                row.finish = "length"  # ("stop" instead if the token is the termination id)
        return rows

    def update(self, batch: Batch, rows: List[Row], result: StepResult,
               handles: tuple) -> None:
        """``update_requests`` with a host mask and the device tokens, then the engine's side
        of it; the step's deliveries wait for the next step."""
        steps = self.steps
        ctx = steps.context
        # A host mask: the context reads it without waiting for the device.
        mask = torch.tensor([r.keep for r in rows], dtype=torch.bool)
        paused = ctx.update_requests(mask, batch.sampled)
        paused_ids = [int(i) for i in paused.tolist()]
        evicted_ids = [int(i) for i in ctx.evicted_request_ids.tolist()]
        deliveries = []
        for i, row in enumerate(rows):
            request_id = row.state.request_id
            if row.finish == "retired":
                self.release(request_id)  # masked: its row is released
                continue
            row.apply_log_probs()
            if request_id != batch.chunked_id:
                deliveries.append(PendingDelivery(i, row.state, row.keep))
        result.paused_ids = [rid for rid in paused_ids if rid not in self.retired]
        evicted_live = []
        for request_id in evicted_ids:
            if not self.release(request_id):
                evicted_live.append(request_id)
            else:
                self.counts["retired_evicted"] += 1
        result.evicted_ids = evicted_live
        if deliveries:
            # Only the evicted rows of this step need their token before a re-admission.
            delivered = {d.state.request_id for d in deliveries}
            self.pending = PendingStep(step=steps.step_count, deliveries=deliveries,
                                        evicted=set(evicted_live) & delivered,
                                        paused=set(result.paused_ids) & delivered,
                                        handle=handles[0], delivered_ids=delivered,
                                        log_prob_handle=handles[1])
        steps.after_update(result)

    # ------------------------------------------------------------------ reading
    def resolve(self, new_tokens: Dict[int, int]) -> None:
        """Read the pending step's tokens, append them, finish the requests that stop, reach
        their length or were refused by sampling; a finished request still in the context
        retires."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        delivery = self.steps.delivery
        tokens = self.readback.read(pending.handle)
        log_probs = None if pending.log_prob_handle is None \
            else self.log_prob_readback.read(pending.log_prob_handle)
        now = time.perf_counter()
        for item in pending.deliveries:
            state = item.state
            token = int(tokens[item.index])
            error = None
            if token == REFUSED:
                reason, error = "error", REFUSED_ERROR
            else:
                if log_probs is not None and state.params.return_log_probs:
                    state.generated_log_probs.append(log_probs[item.index])
                delivery.append_token(state, token, new_tokens, now, step=pending.step)
                reason = finish_reason(state.params, token,
                                       len(state.request.generated_tokens))
            if reason is None:
                continue
            self.finish_or_retire(state, item.kept, reason, now, pending, error)

    def before_suspend(self) -> List[int]:
        """Read the tokens in flight (the checkpoints need them); returns the retired ids,
        which the suspend drops instead of re-queueing."""
        self.resolve(self.carried_tokens)
        retired = list(self.retired)
        for request_id in retired:
            self.release(request_id)
        return retired

    def release(self, request_id: int) -> bool:
        """A retired request's row left the context (masked, evicted, or suspended): its
        result joins the undelivered ones. False when ``request_id`` is not retired."""
        state = self.retired.pop(request_id, None)
        if state is None:
            return False
        reason, finished_at, step, error = self._retired_finish.pop(request_id)
        self.steps.delivery.finish(state, reason, finished_at, step=step, error=error)
        return True

    def finish_or_retire(self, state: RequestState, kept: bool, reason: str, now: float,
                         pending: PendingStep, error: Optional[str]) -> None:
        """A request that finished at ``pending``'s step: delivered now, or retired while its
        row is still in the context (``kept``, not evicted) until an update releases it
        (``release``), so that a delivered request has left the context and its id is free,
        as in the synchronous engine."""
        request_id = state.request_id
        if kept and request_id not in pending.evicted:
            self.retired[request_id] = state
            self._retired_finish[request_id] = (reason, now, pending.step, error)
            self.counts["retired"] += 1
            self.counts["retired_paused"] += request_id in pending.paused
            return
        self.steps.delivery.finish(state, reason, now, step=pending.step, error=error)
        if kept:
            self.steps.scheduler.discard(request_id)  # re-queued for recompute: not wanted
            self.counts["evicted_stops"] += 1
