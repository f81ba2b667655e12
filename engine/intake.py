"""Intake: request ids, the checks of every request against the context's limits, and the
queue (the scheduler's arrivals).

``Intake`` holds the engine's table of requests (``states``: queued, running, or retired under
async scheduling, until their result is delivered). Every check of a call runs before anything
is queued (``engine/validation.py`` for the values; here the limits of the context and the ids
in use), so a refused call changes nothing. A request that passes them but can never run (too
long for ``max_sequence_length``, for the active KV budget, or for ``max_tokens`` without
chunked prefill) is queued as finished, with ``finish_reason="error"``.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dynctx.context import DynamicInferenceContext, DynamicInferenceRequest, SamplingParams

from .results import Delivery
from .scheduler import Scheduler
from .state import RequestState
from .validation import (
    as_list,
    check_int,
    check_prompts,
    check_sampling_params,
    checked_request,
    prompt_tensor,
)


def _gib(value: Optional[float]) -> str:
    return "None" if value is None else f"{value:.6g}"


class Intake:
    """Ids, checks and the queue of one engine (module docstring).

    Args:
        context: the context whose limits a request must fit.
        scheduler: the queue requests are submitted to.
        delivery: where a request that can never run finishes, and whose waiting results
            still hold their ids.
        states: the engine's table of requests, shared with ``delivery``.
        vocab_size: the bound of the prompt token ids (None: unbounded).
    """

    def __init__(self, context: DynamicInferenceContext, scheduler: Scheduler,
                 delivery: Delivery, states: Dict[int, RequestState], *,
                 vocab_size: Optional[int]):
        self.context = context
        self.scheduler = scheduler
        self.delivery = delivery
        self.states = states
        self.vocab_size = vocab_size
        self.metadata_types = getattr(context, "request_metadata_types", None) \
            or DynamicInferenceRequest.get_metadata_types()
        self._next_id = 0

    # ------------------------------------------------------------------ ids
    def in_use(self, request_id: int) -> bool:
        """Queued or running, or finished with its result not yet returned (O(1) but for
        the few undelivered results)."""
        return request_id in self.states or self.delivery.holds(request_id)

    def free_ids(self, count: int) -> List[int]:
        """The next ``count`` ids not in use, from the last one handed out; claims nothing."""
        ids, request_id = [], self._next_id
        while len(ids) < count:
            if not self.in_use(request_id):
                ids.append(request_id)
            request_id += 1
        return ids

    def claim_through(self, request_id: int) -> None:
        """Ids up to ``request_id`` are handed out: the next free id comes after it."""
        self._next_id = request_id + 1

    # ------------------------------------------------------------------ checks
    def check_request(self, request: Any, name: str) -> DynamicInferenceRequest:
        """The engine's own copy of ``request``, checked (values, vocabulary, id not in use)."""
        own = checked_request(request, name, vocab=self.vocab_size,
                              metadata_types=self.metadata_types)
        if self.in_use(own.request_id):
            raise ValueError(f"{name}.request_id={own.request_id} is already in use in the "
                             "engine (queued, running, or finished and not yet returned)")
        return own

    @staticmethod
    def arrival(arrival_step: Any, name: str, now: int) -> int:
        """The step a request reaches the queue: ``arrival_step`` (default, or earlier: now)."""
        if arrival_step is None:
            return now
        return max(check_int(name, arrival_step, low=0), now)

    def check_batch(self, requests: Any, arrival_steps: Any,
                    now: int) -> List[Tuple[DynamicInferenceRequest, int]]:
        """``(own copy, arrival step)`` per request, or the first error; changes nothing."""
        if isinstance(requests, DynamicInferenceRequest):
            raise TypeError("requests is one DynamicInferenceRequest; give a list of them "
                            "(e.g. [request])")
        requests = as_list("requests", requests, "DynamicInferenceRequest")
        if arrival_steps is None:
            delays = [0] * len(requests)
        else:
            delays = as_list("arrival_steps", arrival_steps, "int")
            if len(delays) != len(requests):
                raise ValueError(f"arrival_steps has {len(delays)} entries for "
                                 f"{len(requests)} requests")
            delays = [check_int(f"arrival_steps[{i}]", d, low=0) for i, d in enumerate(delays)]
        first_index: Dict[int, int] = {}
        checked = []
        for i, (request, delay) in enumerate(zip(requests, delays)):
            own = self.check_request(request, f"requests[{i}]")
            if own.request_id in first_index:
                raise ValueError(f"requests[{i}].request_id={own.request_id} repeats "
                                 f"requests[{first_index[own.request_id]}]; ids must be unique")
            first_index[own.request_id] = i
            checked.append((own, now + delay))
        return checked

    def prompt_requests(self, prompts: Any, *, max_new_tokens: Any, sampling_params: Any,
                        termination_id: Any, ignore_eos: Any,
                        default_termination_id: Optional[int]) -> List[DynamicInferenceRequest]:
        """``Engine.generate``'s requests: one per prompt, with the next free ids (not
        claimed), every argument checked first (naming ``prompts[i]``)."""
        prompts = check_prompts(prompts)
        tensors = [prompt_tensor(p, f"prompts[{i}]", self.vocab_size)
                   for i, p in enumerate(prompts)]
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1)
        if termination_id is not None:
            termination_id = check_int("termination_id", termination_id,
                                       low=-2 ** 63, high=2 ** 63 - 1)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos={ignore_eos!r} must be a bool")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            base = sampling_params or SamplingParams(temperature=1.0, top_k=1)
            per_prompt = [check_sampling_params(base, "sampling_params", self.metadata_types)] \
                * len(prompts)
        else:
            per_prompt = as_list("sampling_params", sampling_params, "SamplingParams",
                                 one=True)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"sampling_params has {len(per_prompt)} entries for "
                                 f"{len(prompts)} prompts (give one, or one per prompt)")
            per_prompt = [check_sampling_params(p, f"sampling_params[{i}]", self.metadata_types)
                          for i, p in enumerate(per_prompt)]
        stop = None if ignore_eos else (
            termination_id if termination_id is not None else default_termination_id)
        requests = []
        for prompt, params, request_id in zip(tensors, per_prompt, self.free_ids(len(prompts))):
            params = copy.deepcopy(params)
            params.num_tokens_to_generate = max_new_tokens
            params.num_tokens_total = None
            if termination_id is not None or ignore_eos or params.termination_id is None:
                params.termination_id = stop
            requests.append(DynamicInferenceRequest(request_id=request_id, prompt_tokens=prompt,
                                                    sampling_params=params))
        return requests

    # ------------------------------------------------------------------ the queue
    def enqueue(self, request: DynamicInferenceRequest, arrival: int, now: int) -> None:
        """Track a checked request and submit it to arrive at step ``arrival``; one that can
        never run finishes at once (step ``now``) with an error."""
        state = RequestState(request=request, arrival_step=arrival)
        self.states[request.request_id] = state
        error = self.never_fits(request)
        if error is not None:
            self.delivery.finish(state, "error", time.perf_counter(), step=now, error=error)
            return
        self.scheduler.submit(request.request_id, arrival)

    def never_fits(self, request: DynamicInferenceRequest) -> Optional[str]:
        """Why ``request`` can never run in this context, or None."""
        ctx = self.context
        prompt = len(request.prompt_tokens)
        total = prompt + request.sampling_params.num_tokens_to_generate
        if total > ctx.max_sequence_length:
            return (f"prompt ({prompt}) + num_tokens_to_generate "
                    f"({request.sampling_params.num_tokens_to_generate}) exceeds "
                    f"max_sequence_length ({ctx.max_sequence_length})")
        blocks = math.ceil(total / ctx.block_size_tokens)
        if blocks > ctx.block_allocator.active_count:
            return (f"prompt ({prompt}) + num_tokens_to_generate "
                    f"({request.sampling_params.num_tokens_to_generate}) needs {blocks} KV "
                    f"blocks of block_size_tokens={ctx.block_size_tokens}, more than the "
                    f"active budget of {ctx.block_allocator.active_count} blocks "
                    f"(buffer_size_gb={ctx.buffer_size_gb:.6g}, paused_buffer_size_gb="
                    f"{_gib(ctx.paused_buffer_size_gb)}): raise buffer_size_gb")
        if not self.scheduler.enable_chunked_prefill and prompt > ctx.max_tokens:
            return (f"prompt ({prompt}) exceeds max_tokens ({ctx.max_tokens}) and chunked "
                    "prefill is disabled")
        return None

    def state(self, request_id: int) -> RequestState:
        """The state of a request the context holds (running, or retired in async mode)."""
        state = self.states.get(request_id)
        if state is None:
            raise KeyError(f"internal: request {request_id} is in the context but not in the "
                           "engine")
        return state

    def live_request(self, request_id: int) -> DynamicInferenceRequest:
        """What the context gets for request ``request_id`` (``RequestState.live_request``)."""
        return self.states[request_id].live_request()

    def unfinished_ids(self) -> List[int]:
        """Ids of the requests queued (pending arrival or waiting) or running, sorted."""
        return sorted(self.states)

    def suspended(self, request_ids: Sequence[int]) -> None:
        """The context lets these requests go (``Engine.suspend``): the next admission of each
        starts from a new checkpoint, a recompute when it has generated tokens."""
        for request_id in request_ids:
            state = self.states[request_id]
            state.live = None
            if state.request.generated_tokens:
                state.recompute = True
            else:
                # The prompt runs again from its start: its prompt log probs too.
                state.prompt_log_probs.clear()
