"""The nouns every part of the engine shares: a request's engine-side state, and what one row
of a step yields.

``RequestState`` lives from ``add_request`` until the request's result is handed over
(``engine/intake.py`` creates it, ``engine/results.py`` retires it); ``Row`` is decided by the
step before ``update_requests`` and applied to its ``RequestState`` after it
(``engine/step.py``, ``engine/overlap.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from dynctx.context import DynamicInferenceRequest, SamplingParams


@dataclass
class RequestState:
    """Engine-side state of one request. ``request`` keeps the original prompt and sampling
    params and collects the generated tokens; ``live`` is what the context holds (a
    ``checkpoint()``: prompt + tokens generated before an eviction or suspend)."""

    request: DynamicInferenceRequest
    arrival_step: int
    live: Optional[DynamicInferenceRequest] = None
    recompute: bool = False
    arrival_time: Optional[float] = None
    first_scheduled_step: Optional[int] = None
    first_token_step: Optional[int] = None
    first_token_time: Optional[float] = None
    generated_log_probs: List[float] = field(default_factory=list)
    prompt_log_probs: List[float] = field(default_factory=list)
    num_pauses: int = 0
    num_evictions: int = 0
    num_prefill_chunks: int = 0
    step_logits: List[tuple] = field(default_factory=list)

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def wants_prompt_log_probs(self) -> bool:
        return (self.params.return_log_probs and not self.params.skip_prompt_log_probs
                and not self.recompute)

    def live_request(self) -> DynamicInferenceRequest:
        """What the context gets: a checkpoint (prompt + tokens generated before an eviction
        or suspend), created when the request is first scheduled after one."""
        if self.live is None:
            self.live = self.request.checkpoint()
        return self.live

    def apply_log_probs(self, prompt_log_probs: List[float],
                        generated_log_prob: Optional[float]) -> None:
        """A step's prompt and generated log probs join the request's."""
        self.prompt_log_probs.extend(prompt_log_probs)
        if generated_log_prob is not None:
            self.generated_log_probs.append(generated_log_prob)


@dataclass
class Row:
    """What one active row of a step yields, decided before ``update_requests`` and applied to
    the engine after it: ``token`` (None: a non-final chunk's junk sample, or a failed row),
    ``finish`` (None, ``"stop"``, ``"length"``, ``"error"``; ``"retired"`` under async
    scheduling) and the log probs to record."""

    state: RequestState
    token: Optional[int] = None
    finish: Optional[str] = None
    error: Optional[str] = None
    prompt_log_probs: List[float] = field(default_factory=list)
    generated_log_prob: Optional[float] = None

    @property
    def keep(self) -> bool:
        return self.finish is None

    def apply_log_probs(self) -> None:
        """The row's log probs join its request's."""
        self.state.apply_log_probs(self.prompt_log_probs, self.generated_log_prob)
