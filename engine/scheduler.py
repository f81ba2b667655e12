"""The scheduler: arrivals, FIFO admission with chunked prefill, and re-queueing.

One scheduler, used by ``Engine`` and by the context state-machine test driver
(``tests/context/state_machine.py``). It decides which waiting requests enter the context in a
step and how many prompt tokens each adds; it knows nothing of models, sampling or results.
(``tests/megatron_oracle.py`` keeps its own loop on purpose: a replica of Megatron-Core's.)

Per step, the caller:

1. ``release(step)``: requests whose arrival step has come join the back of ``waiting``;
2. ``schedule(request_for)``: admit from the head of ``waiting`` (docs/SEMANTICS.md §10):

   * the chunked prefill in flight, if any, is at the head; its next chunk goes first, as large
     as the step's token budget and the free KV slots allow (``continuation_room``);
   * then each request whose whole remaining prompt (less what the prefix cache holds of it)
     fits the step's free token budget, while
     ``check_availability`` gives a request row and KV blocks for the whole prompt;
   * the first request whose prompt does not fit the token budget is chunked (when chunked
     prefill is on and the step has room): its first chunk fills the budget and ends the step's
     admission. With chunked prefill off, only a request longer than ``max_tokens`` is chunked
     (an evicted request's recompute, whose prompt holds its generated tokens: it could never
     run whole; new prompts that long are refused by the engine). With
     ``reserve_for_chunks`` (the engine), a prompt is chunked only when the free blocks cover
     its whole prompt plus what the running requests can take before its last chunk (one block
     per ``block_size`` steps each, plus one), so the continuation always finds its blocks;
     without it (the test driver) a continuation may stall (``ChunkStalled``);
   * on a hybrid (Mamba) model nothing is added after a continuation's final chunk: it alone
     starts from its saved Mamba state and must stay the step's last row (docs/SEMANTICS.md
     §0.3); the same holds for a prefix cache hit, which resumes from a Mamba state snapshot,
     and a hybrid's first chunk ends where its cached blocks end when no snapshot exists there
     yet (docs/SEMANTICS.md §17);
3. runs the step and ``update_requests``; then ``after_update(evicted_ids)`` re-queues evicted
   requests at the front (behind the chunked prefill in flight) for recompute.

``requeue_suspended(ids)`` puts a suspended context's requests back at the front, in row order.

Requests are named by id. ``schedule`` gets each request through ``request_for(id)`` (the
caller creates a checkpoint for recompute lazily there) and advances its
``remaining_prompt_tokens`` and ``finished_chunk_token_count`` after each add. A new request
the context refuses (``ValueError``/``TypeError``, or a ``ContextOverflowError`` that is not
transient) leaves the queue and is reported in ``Schedule.refused``: the context's
``add_request`` checks everything before it changes anything, so the other requests go on.

Cost: ``submit`` and ``release`` are O(log n) per request (a heap keyed by arrival step, ties
in submission order); the waiting queue is a deque.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Iterable, List, Optional, Tuple

from dynctx.context import ContextOverflowError, DynamicInferenceRequest

__all__ = ["Admission", "ChunkStalled", "Schedule", "Scheduler"]


class ChunkStalled(RuntimeError):
    """The chunked prefill in flight finds no room for its next chunk (no free KV slot). Never
    raised with ``reserve_for_chunks``; the test driver recovers by suspending."""


@dataclass(frozen=True)
class Admission:
    """One ``add_request`` of a step: ``chunk`` prompt tokens of request ``request_id``;
    ``final``: its prompt's last chunk; ``continuation``: the chunked prefill of the previous
    step continued."""

    request_id: int
    chunk: int
    final: bool
    continuation: bool


@dataclass
class Schedule:
    """What one ``schedule`` call did: the admissions in order, and the new requests the context
    refused (``(request_id, error)``; they left the queue)."""

    admitted: List[Admission] = field(default_factory=list)
    refused: List[Tuple[int, Exception]] = field(default_factory=list)


AddFn = Callable[[DynamicInferenceRequest, Optional[int]], None]
ChunkFn = Callable[[DynamicInferenceRequest, int], int]


def _caches(ctx) -> bool:
    """Whether the context may skip prompt tokens (prefix caching, or KV offload's restores)."""
    return (getattr(ctx, "prefix_cache", None) is not None or bool(getattr(ctx, "kv_offload_gb", 0))
            or getattr(ctx, "kv_cache_management_mode", None) == "offload")


class Scheduler:
    """Admission of queued requests into a ``DynamicInferenceContext`` (module docstring).

    Args:
        context: the context requests are added to (its public API only).
        enable_chunked_prefill: split a prompt longer than the step's free token budget.
        reserve_for_chunks: chunk only when the continuation is sure to find its blocks.
    """

    def __init__(self, context, *, enable_chunked_prefill: bool = True,
                 reserve_for_chunks: bool = True):
        self.context = context
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.reserve_for_chunks = bool(reserve_for_chunks)
        self.waiting: Deque[int] = deque()
        self._arrivals: List[Tuple[int, int, int]] = []
        self._order = itertools.count()
        self._step_closed = False

    # ------------------------------------------------------------------ arrivals
    def submit(self, request_id: int, arrival_step: int) -> None:
        """Queue ``request_id`` to join ``waiting`` at ``release(arrival_step)``; O(log n)."""
        heapq.heappush(self._arrivals, (int(arrival_step), next(self._order), int(request_id)))

    def release(self, step: int) -> List[int]:
        """Move the requests arrived by ``step`` to the back of ``waiting``; returns their ids."""
        released = []
        while self._arrivals and self._arrivals[0][0] <= step:
            released.append(heapq.heappop(self._arrivals)[2])
        self.waiting.extend(released)
        return released

    @property
    def next_arrival_step(self) -> Optional[int]:
        """The earliest arrival step still pending, or None."""
        return self._arrivals[0][0] if self._arrivals else None

    @property
    def pending_count(self) -> int:
        """Requests submitted that have not arrived yet."""
        return len(self._arrivals)

    def has_work(self) -> bool:
        return bool(self._arrivals or self.waiting)

    def queued_ids(self) -> List[int]:
        """Every request id the scheduler holds: waiting (in order), then pending arrivals."""
        return list(self.waiting) + [rid for _, _, rid in sorted(self._arrivals)]

    # ------------------------------------------------------------------ admission
    def continuation_room(self, request: DynamicInferenceRequest) -> int:
        """The largest next chunk of the chunked prefill ``request`` (already the last active
        row, its previous chunk's junk token counted in the step): its remaining prompt,
        capped by the step's token budget and by the KV slots it owns or can get."""
        ctx = self.context
        finished = request.finished_chunk_token_count
        token_room = ctx.max_tokens - ctx.active_token_count + 1
        kv_room = (-finished) % ctx.block_size_tokens \
            + ctx.block_allocator.total_avail * ctx.block_size_tokens
        return min(request.remaining_prompt_length, token_room, kv_room)

    def _chunking_is_safe(self, prompt_length: int, first_chunk: int) -> bool:
        """Blocks for the whole prompt plus what the running requests may take before the
        last chunk is added (each: one block per ``block_size`` steps, plus one)."""
        ctx = self.context
        bs = ctx.block_size_tokens
        others = ctx.get_active_request_count()
        room = max(1, ctx.max_tokens - others)
        steps = math.ceil((prompt_length - first_chunk) / room)
        reserve = others * (math.ceil(steps / bs) + 1)
        return ctx.block_allocator.total_avail >= math.ceil(prompt_length / bs) + reserve

    def _first_chunk(self, request: DynamicInferenceRequest) -> Optional[int]:
        """Tokens a new request adds now (its whole prompt, or a first chunk), or None when it
        must wait (and everything behind it: FIFO)."""
        ctx = self.context
        request_ok, _, kv_ok = ctx.check_availability(request)
        if not (request_ok and kv_ok):
            return None
        remaining = request.remaining_prompt_length
        token_room = ctx.max_tokens - ctx.active_token_count
        # Prefix caching (and KV offload's saved tokens): the cached tokens of the prompt cost
        # no step tokens; a first chunk covers them and fills the budget after them.
        caching = _caches(ctx)
        skip = ctx.prefix_cache_lookup(request) if caching else 0
        if caching and ctx.is_hybrid_model and self.enable_chunked_prefill:
            # A hybrid's first chunk ends where its cached blocks end when the Mamba state
            # there is not snapshotted yet: the snapshot taken then serves later requests.
            boundary = ctx.prefix_cache_first_chunk_boundary(request)
            if boundary and 0 < boundary - skip <= token_room and (
                    not self.reserve_for_chunks or self._chunking_is_safe(remaining, boundary)):
                return boundary
        if remaining - skip <= token_room:
            return remaining
        # With chunked prefill off, a request longer than a whole step (an evicted request's
        # recompute: its prompt and generated tokens) is still chunked: whole, it never runs.
        chunk = self.enable_chunked_prefill or remaining - skip > ctx.max_tokens
        if not chunk or token_room <= 0:
            return None
        if self.reserve_for_chunks and not self._chunking_is_safe(remaining, skip + token_room):
            return None
        return skip + token_room

    def schedule(self, request_for: Callable[[int], DynamicInferenceRequest], *,
                 add: Optional[AddFn] = None, continuation_chunk: Optional[ChunkFn] = None,
                 limit: Optional[int] = None) -> Schedule:
        """Admit from the head of ``waiting`` (module docstring); returns what was added.

        ``request_for(id)``: the request to add (its remaining prompt is advanced here);
        ``add(request, chunk_length)``: the add itself (default ``context.add_request``; the
        test driver checks around it); ``continuation_chunk(request, most)``: the size of the
        chunked prefill's next chunk, in ``[1, most]`` (default ``most``); ``limit``: at most
        this many admissions. Once a step's admission is closed (a non-final chunk was added,
        or a hybrid's final continuation) further calls add nothing until ``after_update``.
        """
        ctx = self.context
        add = ctx.add_request if add is None else add
        done = Schedule()
        while self.waiting and not self._step_closed \
                and (limit is None or len(done.admitted) < limit):
            rid = self.waiting[0]
            request = request_for(rid)
            resumes = False
            chunked_id = ctx.chunked_prefill_request_id
            continuing = chunked_id != -1
            remaining = request.remaining_prompt_length
            if continuing:
                if chunked_id != rid:
                    raise RuntimeError(f"internal: chunked request {chunked_id} is not at the "
                                       f"head of the waiting queue ({rid} is)")
                most = self.continuation_room(request)
                if most <= 0:
                    raise ChunkStalled(
                        f"the continuation of chunked request {rid} finds no room "
                        f"({ctx.block_allocator.total_avail} free blocks, "
                        f"{ctx.active_token_count} of {ctx.max_tokens} tokens in the step)")
                chunk = most if continuation_chunk is None else continuation_chunk(request, most)
                if not 1 <= chunk <= most:
                    raise ValueError(f"continuation_chunk gave {chunk}; it must lie in "
                                     f"[1, {most}]")
            else:
                chunk = self._first_chunk(request)
                if chunk is None:
                    break
                # A hybrid's prefix cache hit (or KV offload restore) resumes from a saved
                # Mamba state as the step's continuation: nothing may be added after it.
                resumes = ctx.is_hybrid_model and _caches(ctx) \
                    and ctx.prefix_cache_lookup(request) > 0
            final = chunk == remaining
            try:
                add(request, None if final else chunk)
            except (ValueError, TypeError, ContextOverflowError) as error:
                transient = isinstance(error, ContextOverflowError) and error.is_transient
                if continuing or transient:
                    raise
                self.waiting.popleft()
                done.refused.append((rid, error))
                continue
            request.remaining_prompt_tokens = request.remaining_prompt_tokens[chunk:]
            request.finished_chunk_token_count += chunk
            done.admitted.append(Admission(rid, chunk, final, continuing))
            if not final:
                ctx.chunked_prefill_request_id = rid
                self._step_closed = True
                break
            self.waiting.popleft()
            if continuing:
                ctx.chunked_prefill_request_id = -1
                if ctx.is_hybrid_model:
                    self._step_closed = True
            elif resumes:
                self._step_closed = True
        return done

    def close_step(self) -> None:
        """Add nothing more in this step (until ``after_update``): a caller that added a
        request outside ``schedule`` that must stay the step's last row (a hybrid's prefix
        cache hit) says so."""
        self._step_closed = True

    def note_chunked_prefill(self, request_id: int) -> None:
        """A first chunk of ``request_id`` was added outside ``schedule`` (the test driver's
        direct adds; the caller set ``chunked_prefill_request_id``): it continues first."""
        self.waiting.appendleft(int(request_id))
        self._step_closed = True

    # ------------------------------------------------------------------ after a step
    def after_update(self, evicted_ids: Iterable[int] = ()) -> None:
        """After ``update_requests``: a new step's admission opens, and the evicted requests
        go back to the front of the queue (in order, behind the chunked prefill in flight) to
        be recomputed."""
        self._step_closed = False
        evicted = [int(rid) for rid in evicted_ids]
        if not evicted:
            return
        at = 1 if self.context.chunked_prefill_request_id != -1 else 0
        for k, rid in enumerate(evicted):
            self.waiting.insert(at + k, rid)

    def requeue_suspended(self, ids: Iterable[int]) -> None:
        """The requests of a context being suspended (``ids`` in row order, the chunked prefill
        in flight included) go back to the front of the queue, in that order."""
        ids = [int(rid) for rid in ids]
        held = set(ids)
        while self.waiting and self.waiting[0] in held:
            self.waiting.popleft()  # the chunked prefill in flight: it restarts from its row
        self.waiting.extendleft(reversed(ids))
        self._step_closed = False

    def discard(self, request_id: int) -> bool:
        """Remove ``request_id`` from the waiting queue (not from pending arrivals); True if it
        was there."""
        try:
            self.waiting.remove(int(request_id))
        except ValueError:
            return False
        return True

    def clear(self) -> None:
        """Forget every queued request (after ``reset()``)."""
        self.waiting.clear()
        self._arrivals.clear()
        self._step_closed = False
