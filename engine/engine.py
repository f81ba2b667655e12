"""A small reference engine: in-flight batching over a ``DynamicInferenceContext``.

One ``step()`` does what Megatron-Core's ``DynamicInferenceEngine`` step does
(docs/SEMANTICS.md §10, §11): release the requests whose arrival step has come into the waiting
queue; schedule from the head of the queue (``check_availability`` / ``add_request``, chunked
prefill when a prompt does not fit the step's token budget); ``initialize_attention_state``;
the model's forward; per-request sampling; the finish mask; ``update_requests``; re-queue
evicted requests at the front for recompute; return finished requests.

Chunked prefill. The chunk is the last request added in its step, and its continuation is the
first request added in the very next step (our context keeps the chunked request in the last
active row and refuses new requests after it). Because the continuation must be scheduled in
the next step, a prompt is chunked only when the free blocks cover its whole prompt plus what
the other running requests can take in the meantime (one block per ``block_size`` steps each,
plus one); so a continuation always finds its blocks.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from dynctx.context import (DynamicInferenceContext, DynamicInferenceRequest, SamplingParams)

from .sampling import sample

StepCallback = Callable[["StepResult"], None]


@dataclass
class RequestResult:
    """A finished request: its tokens, log probs (when asked), finish reason and timings.

    ``finish_reason``: ``"stop"`` (sampled its termination id), ``"length"`` (generated
    ``num_tokens_to_generate`` tokens) or ``"error"`` (rejected; see ``error``). Steps count
    engine steps; times are ``time.perf_counter()`` values. ``step_logits`` (only with
    ``record_logits``): ``(prefix_length, fp32 logits [V])`` for every forward step the request
    took part in, the logits predicting the token after the first ``prefix_length`` tokens of
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


@dataclass
class EngineStats:
    """Counters over the engine's life; ``history`` has one ``StepResult`` per step (without
    its finished list) for plots."""

    forward_steps: int = 0
    idle_steps: int = 0
    tokens_processed: int = 0
    generated_tokens: int = 0
    pauses: int = 0
    evictions: int = 0
    chunked_prefills: int = 0
    prefill_chunks: int = 0
    suspends: int = 0
    peak_kv_utilization: float = 0.0
    peak_active_requests: int = 0
    peak_paused_requests: int = 0
    forward_time_s: float = 0.0
    history: List[StepResult] = field(default_factory=list)


@dataclass
class _Entry:
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


def _transformers_adapters() -> Dict[str, Callable[..., Any]]:
    from dynctx.models import DeepseekV2Adapter, LlamaAdapter

    from dynctx.models import NemotronHAdapter

    return {"NemotronHForCausalLM": NemotronHAdapter.from_transformers,
            "LlamaForCausalLM": LlamaAdapter.from_transformers,
            "DeepseekV2ForCausalLM": DeepseekV2Adapter.from_transformers}


class Engine:
    """In-flight batching engine over one model adapter and one ``DynamicInferenceContext``.

    Args:
        model: an adapter with ``forward(ctx, last_token_only=...)`` (``dynctx.models``).
        context: the context the model reads and writes.
        enable_chunked_prefill: split prompts longer than the step's free token budget.
        seed: seeds the generator of requests without ``SamplingParams.seed``.
        default_termination_id: used by ``generate`` when no ``termination_id`` is given.
        record_logits: keep every step's last-token logits per request (``step_logits``).
        step_callback: called with each ``StepResult`` (streaming).
    """

    def __init__(self, model: Any, context: DynamicInferenceContext, *,
                 enable_chunked_prefill: bool = True, seed: int = 0,
                 default_termination_id: Optional[int] = None, record_logits: bool = False,
                 step_callback: Optional[StepCallback] = None):
        self.model = model
        self.context = context
        self.enable_chunked_prefill = enable_chunked_prefill
        self.default_termination_id = default_termination_id
        self.record_logits = record_logits
        self.step_callback = step_callback
        self.step_count = 0
        self.stats = EngineStats()
        self._rng = np.random.default_rng(seed)
        self._entries: Dict[int, _Entry] = {}
        self._pending: List[_Entry] = []
        self.waiting: deque = deque()
        self._rejected: List[RequestResult] = []
        self._suspended = False
        self._next_request_id = 0
        if hasattr(model, "check_context"):
            model.check_context(context)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_transformers(cls, hf_model: Any, *, rope: str = "table",
                          attention_backend: str = "auto", enable_chunked_prefill: bool = True,
                          seed: int = 0, record_logits: bool = False,
                          step_callback: Optional[StepCallback] = None,
                          **context_kwargs: Any) -> "Engine":
        """Build the adapter for a ``transformers`` causal LM and a context sized for it.

        ``context_kwargs`` go to ``DynamicInferenceContext`` (``buffer_size_gb``,
        ``block_size_tokens``, ``max_tokens``, ``params_dtype``, ``device``,
        ``paused_buffer_size_gb``, ``kernel_backend``, ...). Defaults come from the model:
        ``params_dtype`` and ``device`` of its weights, ``num_layers``, ``kv_channels`` =
        head_dim, ``num_attention_heads`` = ``num_key_value_heads``, ``max_sequence_length`` =
        ``max_position_embeddings``; ``buffer_size_gb`` defaults to 1. ``max_requests`` defaults
        to the context's (about one block per request), capped at ``max_tokens``.
        """
        adapters = _transformers_adapters()
        name = type(hf_model).__name__
        if name not in adapters:
            raise NotImplementedError(f"dynctx has no adapter for {name}; supported model types: "
                                      f"{', '.join(sorted(adapters))}")
        config = hf_model.config
        param = next(hf_model.parameters())
        kwargs = dict(context_kwargs)
        device = torch.device(kwargs.pop("device", None) or param.device)
        dtype = kwargs.pop("params_dtype", None) or param.dtype
        model = adapters[name](hf_model, device=device, dtype=dtype, rope=rope,
                               attention_backend=attention_backend)
        kwargs.setdefault("num_layers", model.num_layers)
        kwargs.setdefault("kv_channels", model.head_dim)
        kwargs.setdefault("num_attention_heads", model.num_kv_heads)
        for key, value in getattr(model, "context_kwargs", {}).items():  # e.g. the MLA cache
            kwargs.setdefault(key, value)
        if getattr(model, "mamba_inference_state_config", None) is not None:
            kwargs.setdefault("mamba_inference_state_config", model.mamba_inference_state_config)
        kwargs.setdefault("max_sequence_length", config.max_position_embeddings)
        kwargs.setdefault("buffer_size_gb", 1.0)
        kwargs.update(params_dtype=dtype, device=device)
        if kwargs.get("max_requests") is None:
            max_tokens = kwargs.get("max_tokens") or DynamicInferenceContext.DEFAULT_MAX_TOKENS
            try:
                context = DynamicInferenceContext(**kwargs)
            except ValueError as exc:
                if "max_requests" not in str(exc):
                    raise
                # The derived max_requests (about one per block) exceeds max_tokens: cap it.
                rounder = DynamicInferenceContext.REQUEST_ROUNDER
                kwargs["max_requests"] = max(rounder, max_tokens - max_tokens % rounder)
                context = DynamicInferenceContext(**kwargs)
        else:
            context = DynamicInferenceContext(**kwargs)
        eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(model, context, enable_chunked_prefill=enable_chunked_prefill, seed=seed,
                   default_termination_id=eos, record_logits=record_logits,
                   step_callback=step_callback)

    # ------------------------------------------------------------------ submission
    def new_request_id(self) -> int:
        while self._next_request_id in self._entries:
            self._next_request_id += 1
        self._next_request_id += 1
        return self._next_request_id - 1

    def add_request(self, request: DynamicInferenceRequest,
                    arrival_step: Optional[int] = None) -> None:
        """Queue a request; it reaches the waiting queue at engine step ``arrival_step`` (default:
        now). The engine keeps its own copy. Requests that can never run (too long for
        ``max_sequence_length``, for the active KV budget, or for ``max_tokens`` without chunked
        prefill) finish at the next step with ``finish_reason="error"``."""
        if not isinstance(request, DynamicInferenceRequest):
            raise TypeError(f"request must be a DynamicInferenceRequest, got "
                            f"{type(request).__name__}")
        rid = request.request_id
        if rid in self._entries:
            raise ValueError(f"request_id={rid} is already in the engine")
        if request.prompt_tokens is None or len(request.prompt_tokens) == 0:
            raise ValueError(f"request {rid}: the prompt is empty")
        params = request.sampling_params
        if params.stop_words:
            raise NotImplementedError("stop_words are not supported by the reference engine")
        if params.top_n_logprobs:
            raise NotImplementedError("top_n_logprobs is not supported by the reference engine")
        if params.num_tokens_total is not None:
            params = copy.deepcopy(params)
            params.num_tokens_to_generate = params.num_tokens_total - len(request.prompt_tokens)
        if params.num_tokens_to_generate is None or params.num_tokens_to_generate < 1:
            raise ValueError(f"request {rid}: num_tokens_to_generate="
                             f"{params.num_tokens_to_generate} must be >= 1")
        own = DynamicInferenceRequest(request_id=rid, prompt_tokens=request.prompt_tokens.clone(),
                                      sampling_params=params, prompt=request.prompt)
        arrival = self.step_count if arrival_step is None else max(int(arrival_step),
                                                                   self.step_count)
        entry = _Entry(request=own, arrival_step=arrival)
        self._entries[rid] = entry
        error = self._never_fits(own)
        if error is not None:
            self._reject(entry, error)
            return
        self._pending.append(entry)
        self._pending.sort(key=lambda e: e.arrival_step)

    def _never_fits(self, request: DynamicInferenceRequest) -> Optional[str]:
        ctx = self.context
        prompt = len(request.prompt_tokens)
        total = prompt + request.sampling_params.num_tokens_to_generate
        if total > ctx.max_sequence_length:
            return (f"prompt ({prompt}) + num_tokens_to_generate "
                    f"({request.sampling_params.num_tokens_to_generate}) exceeds "
                    f"max_sequence_length ({ctx.max_sequence_length})")
        blocks = math.ceil(total / ctx.block_size_tokens)
        if blocks > ctx.block_allocator.active_count:
            return (f"needs {blocks} KV blocks, more than the active budget of "
                    f"{ctx.block_allocator.active_count} blocks")
        if not self.enable_chunked_prefill and prompt > ctx.max_tokens:
            return (f"prompt ({prompt}) exceeds max_tokens ({ctx.max_tokens}) and chunked "
                    "prefill is disabled")
        return None

    def _reject(self, entry: _Entry, error: str) -> None:
        self._entries.pop(entry.request_id, None)
        self._rejected.append(RequestResult(
            request_id=entry.request_id, prompt_tokens=entry.request.prompt_tokens.tolist(),
            generated_tokens=[], finish_reason="error", error=error,
            arrival_step=entry.arrival_step))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending or self.waiting or self._rejected
                    or (not self._suspended and self.context.has_unfinished_requests()))

    # ------------------------------------------------------------------ scheduling
    def _release_arrivals(self) -> None:
        now = time.perf_counter()
        while self._pending and self._pending[0].arrival_step <= self.step_count:
            entry = self._pending.pop(0)
            entry.arrival_time = now
            self.waiting.append(entry.request_id)

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

    def _schedule(self) -> None:
        ctx = self.context
        bs = ctx.block_size_tokens
        while self.waiting:
            rid = self.waiting[0]
            entry = self._entries[rid]
            chunked_id = ctx.chunked_prefill_request_id
            continuing = chunked_id != -1
            if continuing and chunked_id != rid:
                raise RuntimeError(f"internal: chunked request {chunked_id} is not at the head of "
                                   f"the waiting queue ({rid} is)")
            if entry.live is None:
                entry.live = entry.request.checkpoint()
            live = entry.live
            remaining = live.remaining_prompt_length
            finished = live.finished_chunk_token_count
            request_ok, _, kv_ok = ctx.check_availability(live)
            token_room = ctx.max_tokens - ctx.active_token_count + (1 if continuing else 0)
            if continuing:
                kv_room = (-finished) % bs + ctx.block_allocator.total_avail * bs
                chunk = min(remaining, token_room, kv_room)
                if chunk <= 0:
                    raise RuntimeError(
                        f"internal: the continuation of chunked request {rid} finds no room "
                        f"({token_room} tokens, {kv_room} KV slots)")
            else:
                if not (request_ok and kv_ok):
                    break
                if remaining <= token_room:
                    chunk = remaining
                elif (self.enable_chunked_prefill and token_room > 0
                      and self._chunking_is_safe(remaining, token_room)):
                    chunk = token_room
                else:
                    break
            final = chunk == remaining
            ctx.add_request(live, None if final else chunk)
            live.remaining_prompt_tokens = live.remaining_prompt_tokens[chunk:]
            live.finished_chunk_token_count += chunk
            if entry.first_scheduled_step is None:
                entry.first_scheduled_step = self.step_count
            if continuing or not final:
                entry.num_prefill_chunks += 1
                self.stats.prefill_chunks += 1
                if not continuing:
                    self.stats.chunked_prefills += 1
            if final:
                self.waiting.popleft()
                if continuing:
                    ctx.chunked_prefill_request_id = -1
                    if ctx.is_hybrid_model:
                        # A hybrid's continuation must stay the step's last row: it alone
                        # starts from its saved Mamba state (docs/SEMANTICS.md §0.3).
                        break
                continue
            ctx.chunked_prefill_request_id = rid
            break

    # ------------------------------------------------------------------ the step
    def step(self) -> StepResult:
        """Run one engine step (see the module docstring) and return what it did."""
        if self._suspended:
            raise RuntimeError("the engine is suspended; call resume() first")
        ctx = self.context
        started = time.perf_counter()
        self._release_arrivals()
        self._schedule()
        result = StepResult(step=self.step_count, finished=self._rejected)
        self._rejected = []
        if ctx.active_token_count == 0:
            if self.waiting:
                raise RuntimeError(f"internal: request {self.waiting[0]} cannot be scheduled into "
                                   "an empty context")
            result.idle = True
            self.stats.idle_steps += 1
            next_step = self.step_count + 1
            if self._pending:
                next_step = max(next_step, self._pending[0].arrival_step)
            self.step_count = next_step
            return self._finish_step(result, started)

        ctx.initialize_attention_state()
        P, T = ctx.paused_request_count, ctx.total_request_count
        ids = [int(i) for i in ctx.host_request_ids()[P:T]]
        entries = [self._entries[i] for i in ids]
        num_decode = ctx.num_decode_requests
        chunked_id = ctx.chunked_prefill_request_id
        stats = ctx.get_kvcache_utilization_stats()
        result.active_requests, result.paused_requests = T - P, P
        result.tokens = ctx.active_token_count
        result.kv_utilization = stats["allocated_utilization"]

        want_prompt_lp = any(e.wants_prompt_log_probs for e in entries[num_decode:])
        want_lp = any(e.params.return_log_probs for e in entries)
        forward_start = time.perf_counter()
        output = self.model.forward(ctx, last_token_only=not want_prompt_lp)
        last = ctx.last_token_logits(output) if want_prompt_lp else output
        sampled = sample(last, [e.params for e in entries],
                         [len(e.request.generated_tokens) for e in entries], self._rng)
        log_prob_lists = full_log_probs = None
        if want_lp:
            if want_prompt_lp:
                log_prob_lists, full_log_probs = ctx.calculate_log_probs(output, sampled)
            else:
                log_prob_lists, full_log_probs = ctx.calculate_log_probs(
                    last, sampled, only_last_token_logits=True)
        if self.record_logits:
            prefix = ctx.active_attn_metadata.kv_seq_lengths[:T - P].tolist()
            rows = last.float().cpu()
            for i, entry in enumerate(entries):
                entry.step_logits.append((int(prefix[i]), rows[i].clone()))
        tokens = sampled.tolist()
        self.stats.forward_time_s += time.perf_counter() - forward_start

        now = time.perf_counter()
        mask, done = [], []
        cu_query = None
        for i, (entry, token) in enumerate(zip(entries, tokens)):
            is_chunk = entry.request_id == chunked_id
            if log_prob_lists is not None and entry.params.return_log_probs:
                values = log_prob_lists[i]
                if entry.wants_prompt_log_probs and i >= num_decode and want_prompt_lp:
                    entry.prompt_log_probs.extend(values[:-1])
                    if is_chunk:
                        # The chunk's last position predicts the next chunk's first token.
                        if cu_query is None:
                            cu_query = ctx.active_attn_metadata.cu_query_seq_lengths.tolist()
                        row = cu_query[i + 1] - 1
                        next_token = int(entry.live.remaining_prompt_tokens[0])
                        entry.prompt_log_probs.append(float(full_log_probs[row, next_token]))
                if not is_chunk:
                    entry.generated_log_probs.append(values[-1])
            if is_chunk:
                mask.append(True)
                continue
            generated = entry.request.generated_tokens
            generated.append(token)
            result.new_tokens[entry.request_id] = token
            if entry.first_token_step is None:
                entry.first_token_step, entry.first_token_time = self.step_count, now
            termination = entry.params.termination_id
            stop = termination is not None and termination >= 0 and token == termination
            finish = stop or len(generated) >= entry.params.num_tokens_to_generate
            mask.append(not finish)
            if finish:
                done.append((entry, "stop" if stop else "length"))
        self.stats.generated_tokens += len(result.new_tokens)

        active_mask = torch.tensor(mask, dtype=torch.bool, device=ctx.device)
        paused = ctx.update_requests(active_mask, sampled)
        result.paused_ids = [int(i) for i in paused.tolist()]
        result.evicted_ids = [int(i) for i in ctx.evicted_request_ids.tolist()]
        for rid in result.paused_ids:
            self._entries[rid].num_pauses += 1
        for entry, reason in done:
            result.finished.append(self._finish(entry, reason, now))
        if result.evicted_ids:
            # Recompute later, before everything else but a chunked prefill in flight.
            at = 1 if ctx.chunked_prefill_request_id != -1 else 0
            for k, rid in enumerate(result.evicted_ids):
                entry = self._entries[rid]
                entry.live, entry.recompute = None, True
                entry.num_evictions += 1
                self.waiting.insert(at + k, rid)
        self.stats.forward_steps += 1
        self.stats.tokens_processed += result.tokens
        self.stats.pauses += len(result.paused_ids)
        self.stats.evictions += len(result.evicted_ids)
        self.stats.peak_kv_utilization = max(self.stats.peak_kv_utilization,
                                             result.kv_utilization)
        self.stats.peak_active_requests = max(self.stats.peak_active_requests,
                                              result.active_requests)
        self.stats.peak_paused_requests = max(self.stats.peak_paused_requests,
                                              ctx.paused_request_count, result.paused_requests)
        self.step_count += 1
        return self._finish_step(result, started)

    def _finish_step(self, result: StepResult, started: float) -> StepResult:
        result.time_s = time.perf_counter() - started
        self.stats.history.append(copy.copy(result))
        self.stats.history[-1].finished = []
        if self.step_callback is not None:
            self.step_callback(result)
        return result

    def _finish(self, entry: _Entry, reason: str, now: float) -> RequestResult:
        del self._entries[entry.request_id]
        request = entry.request
        params = request.sampling_params
        return RequestResult(
            request_id=entry.request_id, prompt_tokens=request.prompt_tokens.tolist(),
            generated_tokens=list(request.generated_tokens), finish_reason=reason,
            generated_log_probs=list(entry.generated_log_probs) if params.return_log_probs
            else None,
            prompt_log_probs=list(entry.prompt_log_probs)
            if params.return_log_probs and not params.skip_prompt_log_probs else None,
            arrival_step=entry.arrival_step, first_scheduled_step=entry.first_scheduled_step,
            first_token_step=entry.first_token_step, finish_step=self.step_count,
            arrival_time=entry.arrival_time, first_token_time=entry.first_token_time,
            finish_time=now, num_pauses=entry.num_pauses, num_evictions=entry.num_evictions,
            num_prefill_chunks=entry.num_prefill_chunks,
            step_logits=list(entry.step_logits) if self.record_logits else None)

    # ------------------------------------------------------------------ suspend / resume
    @property
    def suspended(self) -> bool:
        return self._suspended

    def suspend(self) -> None:
        """Free the context's tensors; the in-flight requests go back to the front of the
        waiting queue (in row order) and are recomputed after ``resume()``."""
        if self._suspended:
            return
        ctx = self.context
        ids = [int(i) for i in ctx.host_request_ids()[:ctx.total_request_count]]
        if ctx.chunked_prefill_request_id != -1:
            self.waiting.popleft()  # the chunked request is in ``ids`` too
        for rid in reversed(ids):
            entry = self._entries[rid]
            entry.live = None
            if entry.request.generated_tokens:
                entry.recompute = True
            else:
                # The prompt runs again from its start: its prompt log probs too.
                entry.prompt_log_probs.clear()
            self.waiting.appendleft(rid)
        ctx.deallocate_all_tensors()
        self._suspended = True
        self.stats.suspends += 1

    def resume(self) -> None:
        """Re-allocate the context's tensors; the next steps re-add the suspended requests."""
        if not self._suspended:
            return
        self.context.allocate_all_tensors(is_init=False)
        self._suspended = False

    # ------------------------------------------------------------------ batch APIs
    def run(self) -> List[RequestResult]:
        """Step until every queued request has finished; return them in finishing order."""
        results: List[RequestResult] = []
        while self.has_unfinished_requests():
            results.extend(self.step().finished)
        return results

    def generate_requests(self, requests: Sequence[DynamicInferenceRequest],
                          arrival_steps: Optional[Sequence[int]] = None) -> List[RequestResult]:
        """Run ``requests`` (request ``i`` reaches the queue ``arrival_steps[i]`` steps from
        now) to completion; returns their results in the order given."""
        if arrival_steps is not None and len(arrival_steps) != len(requests):
            raise ValueError(f"arrival_steps has {len(arrival_steps)} entries for "
                             f"{len(requests)} requests")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        for i, request in enumerate(requests):
            delay = 0 if arrival_steps is None else int(arrival_steps[i])
            if delay < 0:
                raise ValueError(f"arrival_steps[{i}]={delay} must be >= 0")
            self.add_request(request, arrival_step=self.step_count + delay)
        wanted = set(ids)
        results: Dict[int, RequestResult] = {}
        while wanted - results.keys():
            if not self.has_unfinished_requests():
                raise RuntimeError("internal: the engine ran out of work with requests unfinished")
            for finished in self.step().finished:
                results[finished.request_id] = finished
        return [results[i] for i in ids]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16,
                 arrival_steps: Optional[Sequence[int]] = None,
                 sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
                 termination_id: Optional[int] = None,
                 ignore_eos: bool = False) -> List[List[int]]:
        """Generate for token-id prompts; ``outputs[i]`` lists the ids generated for
        ``prompts[i]``.

        Greedy unless ``sampling_params`` (one for all, or one per prompt) are given; their
        ``num_tokens_to_generate`` is replaced by ``max_new_tokens``. Generation stops at
        ``termination_id`` (default: the model's EOS id, as ``transformers.generate`` does;
        ``ignore_eos=True``: never) or after ``max_new_tokens`` tokens. A request that cannot
        run raises ``RuntimeError``.
        """
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            base = sampling_params or SamplingParams(temperature=1.0, top_k=1)
            per_prompt = [base] * len(prompts)
        else:
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        stop = None if ignore_eos else (
            termination_id if termination_id is not None else self.default_termination_id)
        requests = []
        for prompt, params in zip(prompts, per_prompt):
            params = copy.deepcopy(params)
            params.num_tokens_to_generate = max_new_tokens
            params.num_tokens_total = None
            if termination_id is not None or ignore_eos or params.termination_id is None:
                params.termination_id = stop
            requests.append(DynamicInferenceRequest(
                request_id=self.new_request_id(),
                prompt_tokens=torch.as_tensor(list(prompt), dtype=torch.int64),
                sampling_params=params))
        results = self.generate_requests(requests, arrival_steps)
        errors = [f"prompt {i}: {r.error}" for i, r in enumerate(results)
                  if r.finish_reason == "error"]
        if errors:
            raise RuntimeError("generate: " + "; ".join(errors))
        return [r.generated_tokens for r in results]
