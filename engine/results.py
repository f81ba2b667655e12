"""Results and their delivery: what a finished request and a step give back, the engine's
counters, and ``Delivery``, the one object through which the synchronous step
(``engine/step.py``) and async scheduling (``engine/overlap.py``) finish requests and hand
their results over.

A finished request's result waits in ``Delivery`` until a step completes: ``close_step`` hands
every waiting result over (``StepResult.finished``), calls the step callback, and only then
forgets what it delivered. A step callback or metrics writer that raises propagates with the
results kept for the next step (docs: the module docstring of ``engine/engine.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence

from .state import RequestState, Row

# Steps kept in ``EngineStats.history`` by default: a long demo's plot, a few MB at most.
DEFAULT_HISTORY_WINDOW = 10_000


@dataclass
class RequestResult:
    """A finished request: its tokens, log probs (when asked), finish reason and timings.

    ``finish_reason``: ``"stop"`` (sampled its termination id), ``"length"`` (generated
    ``num_tokens_to_generate`` tokens) or ``"error"`` (rejected, or its logits gave no
    distribution to sample from; see ``error``). Steps count engine steps; times are
    ``time.perf_counter()`` values. ``step_logits`` (only with ``record_logits``):
    ``(prefix_length, fp32 logits [V])`` for every forward step the request took part in, the
    logits predicting the token after the first ``prefix_length`` tokens of
    ``prompt_tokens + generated_tokens``.
    """

    request_id: int
    prompt_tokens: List[int]
    generated_tokens: List[int]
    finish_reason: str
    error: Optional[str] = None
    generated_log_probs: Optional[List[float]] = None
    prompt_log_probs: Optional[List[float]] = None
    arrival_step: Optional[int] = None
    first_scheduled_step: Optional[int] = None
    first_token_step: Optional[int] = None
    finish_step: Optional[int] = None
    arrival_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_pauses: int = 0
    num_evictions: int = 0
    num_prefill_chunks: int = 0
    step_logits: Optional[List[tuple]] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> Optional[float]:
        if self.finish_time is None or self.arrival_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass
class StepResult:
    """What one ``step()`` did; the per-step callback receives it (streaming)."""

    step: int
    new_tokens: Dict[int, int] = field(default_factory=dict)
    finished: List[RequestResult] = field(default_factory=list)
    paused_ids: List[int] = field(default_factory=list)
    evicted_ids: List[int] = field(default_factory=list)
    active_requests: int = 0
    paused_requests: int = 0
    tokens: int = 0
    kv_utilization: float = 0.0
    idle: bool = False
    time_s: float = 0.0
    # Speculative decoding: every token each request gained this step (up to 1 + k, in
    # order; ``new_tokens`` holds the last); empty without speculation.
    all_new_tokens: Dict[int, List[int]] = field(default_factory=dict)


@dataclass
class EngineStats:
    """Counters over the engine's life. ``history`` keeps one compact ``StepResult`` per step
    (its ``finished`` and ``new_tokens`` left out) for plots: the last ``history_window`` steps
    (``Engine(history_window=...)``; ``None`` keeps every step, 0 none)."""

    forward_steps: int = 0
    idle_steps: int = 0
    tokens_processed: int = 0
    generated_tokens: int = 0
    pauses: int = 0
    evictions: int = 0
    chunked_prefills: int = 0
    prefill_chunks: int = 0
    suspends: int = 0
    errors: int = 0
    peak_kv_utilization: float = 0.0
    peak_active_requests: int = 0
    peak_paused_requests: int = 0
    forward_time_s: float = 0.0
    # The context's prefix caching counters (``get_prefix_cache_stats``), refreshed each step;
    # empty without caching. ``prefix_cache_hit_rate``: hits per new request added.
    prefix_cache: Dict[str, float] = field(default_factory=dict)
    # Speculative decoding's counters (``engine/speculative.py``, ``SpeculativeStats``);
    # empty without speculation.
    speculative: Dict[str, float] = field(default_factory=dict)
    history: Deque[StepResult] = field(
        default_factory=lambda: deque(maxlen=DEFAULT_HISTORY_WINDOW))


class Delivery:
    """The finished results not yet handed over, and how a request gets there.

    ``states`` is the engine's table of requests (``engine/intake.py``): a request that
    finishes leaves it. ``stats`` is updated as requests finish and steps are counted.
    """

    def __init__(self, states: Dict[int, RequestState], stats: EngineStats, *,
                 record_logits: bool):
        self.states = states
        self.stats = stats
        self.record_logits = record_logits
        self._waiting: List[RequestResult] = []

    # ------------------------------------------------------------------ what waits
    @property
    def undelivered(self) -> List[RequestResult]:
        """A copy of the results waiting to be handed over, oldest first."""
        return list(self._waiting)

    def has_undelivered(self) -> bool:
        return bool(self._waiting)

    def holds(self, request_id: int) -> bool:
        """A result of ``request_id`` waits (O(results waiting), a few at most)."""
        return any(r.request_id == request_id for r in self._waiting)

    def hand_back(self, results: Sequence[RequestResult]) -> None:
        """Results a batch call had collected but not returned (it raised, or they were not
        its own) go back to the front, to be delivered with the next step."""
        self._waiting[:0] = list(results)

    # ------------------------------------------------------------------ finishing
    def finish(self, state: RequestState, reason: str, now: float, *, step: int,
               error: Optional[str] = None) -> None:
        """The request's result joins the waiting ones and the engine forgets the request.
        ``step``: the step that sampled its last token (or refused it)."""
        del self.states[state.request_id]
        request = state.request
        params = request.sampling_params
        if reason == "error":
            self.stats.errors += 1
        self._waiting.append(RequestResult(
            request_id=state.request_id, prompt_tokens=request.prompt_tokens.tolist(),
            generated_tokens=list(request.generated_tokens), finish_reason=reason, error=error,
            generated_log_probs=list(state.generated_log_probs) if params.return_log_probs
            else None,
            prompt_log_probs=list(state.prompt_log_probs)
            if params.return_log_probs and not params.skip_prompt_log_probs else None,
            arrival_step=state.arrival_step, first_scheduled_step=state.first_scheduled_step,
            first_token_step=state.first_token_step, finish_step=step,
            arrival_time=state.arrival_time, first_token_time=state.first_token_time,
            finish_time=now, num_pauses=state.num_pauses, num_evictions=state.num_evictions,
            num_prefill_chunks=state.num_prefill_chunks,
            step_logits=list(state.step_logits) if self.record_logits else None))

    def append_token(self, state: RequestState, token: int, new_tokens: Dict[int, int],
                     now: float, *, step: int) -> None:
        """``token`` (sampled in ``step``) joins the request's and the step's new tokens."""
        state.request.generated_tokens.append(token)
        new_tokens[state.request_id] = token
        if state.first_token_step is None:
            state.first_token_step, state.first_token_time = step, now

    def apply(self, row: Row, result: StepResult, now: float, *, step: int) -> None:
        """A row of the synchronous step after its update: log probs, token, finish."""
        row.apply_log_probs()
        if row.token is not None:
            self.append_token(row.state, row.token, result.new_tokens, now, step=step)
        if row.finish is not None:
            self.finish(row.state, row.finish, now, step=step, error=row.error)

    # ------------------------------------------------------------------ closing a step
    def count(self, result: StepResult, context: Any) -> None:
        """A forward step's counts join the stats."""
        stats = self.stats
        stats.forward_steps += 1
        stats.tokens_processed += result.tokens
        stats.generated_tokens += len(result.new_tokens)
        stats.pauses += len(result.paused_ids)
        stats.evictions += len(result.evicted_ids)
        stats.peak_kv_utilization = max(stats.peak_kv_utilization, result.kv_utilization)
        if getattr(context, "prefix_cache", None) is not None:
            stats.prefix_cache = context.get_prefix_cache_stats()
        stats.peak_active_requests = max(stats.peak_active_requests, result.active_requests)
        stats.peak_paused_requests = max(stats.peak_paused_requests,
                                         context.paused_request_count, result.paused_requests)

    def close_step(self, result: StepResult, started: float, *,
                   deferred: Optional[BaseException],
                   callback: Optional[Callable[[StepResult], None]]) -> StepResult:
        """Hand the waiting results over, record the step, call the callback; an error of
        the callback or of the metrics writer (``deferred``) propagates with the results kept
        waiting."""
        result.time_s = time.perf_counter() - started
        result.finished = list(self._waiting)
        if self.stats.history.maxlen != 0:
            self.stats.history.append(replace(result, new_tokens={}, finished=[],
                                                     all_new_tokens={}))
        if callback is not None:
            try:
                callback(result)
            except BaseException as error:
                if deferred is not None and error.__context__ is None:
                    error.__context__ = deferred  # the metrics writer raised first
                raise
        if deferred is not None:
            raise deferred
        # Only what this step delivered: a result finished inside the callback (a suspend that
        # reads the tokens in flight, a request added that can never run) waits for the next.
        del self._waiting[:len(result.finished)]
        return result


class DeferredWriter:
    """Stands in for the context's ``metrics_writer`` during a step: forwards ``log`` and keeps
    the first error it raises, for the engine to raise once the step is complete."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.error: Optional[BaseException] = None

    def log(self, data: dict) -> None:
        try:
            self.writer.log(data)
        except Exception as error:  # noqa: BLE001 - raised again by the engine after the step
            if self.error is None:
                self.error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)


@contextlib.contextmanager
def deferred_metrics(context: Any) -> Iterator[Optional[DeferredWriter]]:
    """The context's metrics writer, if any, wrapped in a ``DeferredWriter`` for one step."""
    writer = getattr(context, "metrics_writer", None)
    if writer is None:
        yield None
        return
    deferred = DeferredWriter(writer)
    context.metrics_writer = deferred
    try:
        yield deferred
    finally:
        context.metrics_writer = writer
