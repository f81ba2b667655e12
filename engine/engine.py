"""A small reference engine: in-flight batching over a ``DynamicInferenceContext``.

One ``step()`` does what Megatron-Core's ``DynamicInferenceEngine`` step does (docs/SEMANTICS.md
§10, §11): admit requests (arrivals, FIFO admission, chunked prefill: ``Scheduler`` in
``engine/scheduler.py``); ``initialize_attention_state``; the model's forward; per-request
sampling; the finish mask; ``update_requests``; re-queue evicted requests at the front for
recompute; return the finished requests. With ``async_scheduling=True`` the sampled tokens are
read one step late, after the next step's forward is launched (``engine/overlap.py``).

Requests are isolated from each other:

* ``add_request``, ``generate_requests`` and ``generate`` check every argument of the call before
  they queue anything (request ids, prompts, sampling parameters, arrival steps, against the
  limits of the context and the model's vocabulary). A bad one raises ``TypeError`` or
  ``ValueError`` naming the argument, the value and the limit, and the engine and the context are
  exactly as before the call.
* A request that passes these checks but cannot be served finishes with
  ``finish_reason="error"`` and a message in ``RequestResult.error``, while every other request
  goes on: one too long for the context (at the next step), one the context refuses when it is
  added, one the scheduler cannot place even in an empty context (no such case is known), and,
  when the context has ``validate=True``, one whose logits hold NaN or +inf (NaN never reaches
  sampling). With the context's ``validate`` or ``vocab_size`` set, the model
  computes every token's logits and the engine picks the last-token rows through the context
  (whose checks are then made on logits; the LM head also runs on prefill tokens).
* A ``step_callback`` or the context's ``metrics_writer`` that raises: the step completes first,
  so that the engine and the context agree, and then the error propagates out of ``step()``.
  No result is lost: the finished results of a step that raised stay undelivered, and the next
  ``step()`` returns them (in its ``finished`` list, and to its callback, again). ``run``,
  ``generate_requests`` and ``generate`` likewise hand back, to the next call, the results they
  had collected when a step raised.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import pickle
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from dynctx.context import DynamicInferenceContext, DynamicInferenceRequest, SamplingParams
from dynctx.context.parallel import CountAgreement, joins_agreement_on_failure
from dynctx.kernels.devices import indexed_device

from .graphs import graph_attention_backend, make_graph_runner
from .overlap import AsyncScheduling, refuse_conflicts
from .sampling import finish_reason, sample
from .scheduler import Admission, Scheduler
from .validation import (
    check_int,
    check_prompts,
    check_sampling_params,
    checked_request,
    prompt_tensor,
    vocab_limit,
)

StepCallback = Callable[["StepResult"], None]

# Steps kept in ``EngineStats.history`` by default: a long demo's plot, a few MB at most.
DEFAULT_HISTORY_WINDOW = 10_000


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
    history: Deque[StepResult] = field(
        default_factory=lambda: deque(maxlen=DEFAULT_HISTORY_WINDOW))


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
    """The dedicated adapters by model class; every other model takes the generic path."""
    from dynctx.models import DeepseekV2Adapter, LlamaAdapter, NemotronHAdapter

    return {"NemotronHForCausalLM": NemotronHAdapter.from_transformers,
            "LlamaForCausalLM": LlamaAdapter.from_transformers,
            "DeepseekV2ForCausalLM": DeepseekV2Adapter.from_transformers,
            "DeepseekV3ForCausalLM": DeepseekV2Adapter.from_transformers}


INTEGRATIONS = ("auto", "generic")


def _adapter_for(hf_model: Any, attention_backend: str, graphs: bool,
                 integration: str = "auto") -> tuple:
    """``(build, attention_backend)``: the dedicated adapter of ``hf_model``'s class (unless
    ``integration="generic"``), else the generic transformers path (``models/generic.py``),
    whose ``"auto"`` attention is the padded torch version with CUDA graphs when the model has
    windows or sinks."""
    from dynctx.models import GenericAdapter

    if integration not in INTEGRATIONS:
        raise ValueError(f"integration={integration!r} must be one of {INTEGRATIONS}")
    adapters = _transformers_adapters()
    name = type(hf_model).__name__
    if name in adapters and integration == "auto":
        return adapters[name], attention_backend
    if graphs and attention_backend == "auto" and GenericAdapter.needs_window_backend(hf_model):
        attention_backend = "torch_static"
    return GenericAdapter.from_transformers, attention_backend


@dataclass
class _Row:
    """What one active row of a step yields, decided before ``update_requests`` and applied to
    the engine after it: ``token`` (None: a non-final chunk's junk sample, or a failed row),
    ``finish`` (None, ``"stop"``, ``"length"`` or ``"error"``) and the log probs to record."""

    entry: _Entry
    token: Optional[int] = None
    finish: Optional[str] = None
    error: Optional[str] = None
    prompt_log_probs: List[float] = field(default_factory=list)
    generated_log_prob: Optional[float] = None

    @property
    def keep(self) -> bool:
        return self.finish is None


@dataclass
class _Batch:
    """One forward step: the active rows in order, the sampled tokens (``sampled`` on the
    device; ``tokens`` on the host, empty under async scheduling), the rows whose logits failed
    the check, and the log probs when asked."""

    entries: List[_Entry]
    num_decode: int
    chunked_id: int
    sampled: torch.Tensor
    tokens: List[int]
    failed: Dict[int, str]
    want_prompt_log_probs: bool
    log_prob_lists: Optional[List[List[float]]] = None
    full_log_probs: Optional[torch.Tensor] = None
    # Async scheduling, a step without prompt log probs: the sampled tokens' log probs on the
    # device, read with the tokens (engine/overlap.py).
    deferred_log_probs: Optional[torch.Tensor] = None


class _DeferredWriter:
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


class Engine:
    """In-flight batching engine over one model adapter and one ``DynamicInferenceContext``.

    Args:
        model: an adapter with ``forward(ctx, last_token_only=...)`` (``dynctx.models``); its
            ``vocab_size``, when it has one, bounds the prompt token ids.
        context: the context the model reads and writes.
        enable_chunked_prefill: split prompts longer than the step's free token budget.
        seed: seeds the generator of requests without ``SamplingParams.seed``.
        default_termination_id: used by ``generate`` when no ``termination_id`` is given.
        record_logits: keep every step's last-token logits per request (``step_logits``).
        step_callback: called with each ``StepResult`` (streaming); an error it raises
            propagates out of ``step()`` once the step is complete (module docstring).
        history_window: steps kept in ``stats.history`` (``None``: all, 0: none).
        cuda_graphs: when the context has a CUDA graph ladder (``num_cuda_graphs``), capture the
            model's forward per graph batch dimension now and replay it on the steps the context
            puts in a graph (``engine/graphs.py``: ``torch.cuda.CUDAGraph`` on CUDA, the stand-in
            runner elsewhere); ``False`` runs every forward eagerly, padded to the graph shapes.
            The context must be empty. ``self.graph_runner`` is the runner (None without graphs).
        async_scheduling: step n+1's host work runs while the device computes step n; the
            sampled tokens are read one step late (``engine/overlap.py``): a step's
            ``new_tokens`` and ``finished`` are those of the step before, and a request whose
            token is its termination id runs one more step (its token discarded; its result
            comes once its row leaves the context, later when that step found it paused). Greedy
            outputs equal the synchronous engine's. Refused (``ValueError``) with the context's
            ``validate=True`` and with ``record_logits=True``; log probs work (a step with
            prompt log probs reads them on the host before the update).
    """

    @joins_agreement_on_failure
    def __init__(self, model: Any, context: DynamicInferenceContext, *,
                 enable_chunked_prefill: bool = True, seed: int = 0,
                 default_termination_id: Optional[int] = None, record_logits: bool = False,
                 step_callback: Optional[StepCallback] = None,
                 history_window: Optional[int] = DEFAULT_HISTORY_WINDOW,
                 cuda_graphs: bool = True, async_scheduling: bool = False):
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            # A rank whose arguments fail below still joins the agreement (as failed), so that
            # every rank raises instead of waiting for it.
            self._agreement = CountAgreement([tp.group], what="build their engines")
        seed = check_int("seed", seed, low=0)
        for name, flag in (("enable_chunked_prefill", enable_chunked_prefill),
                           ("record_logits", record_logits), ("cuda_graphs", cuda_graphs),
                           ("async_scheduling", async_scheduling)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name}={flag!r} must be a bool")
        if default_termination_id is not None:
            default_termination_id = check_int("default_termination_id", default_termination_id)
        if history_window is not None:
            history_window = check_int("history_window", history_window, low=0)
        if step_callback is not None and not callable(step_callback):
            raise TypeError(f"step_callback={step_callback!r} must be callable or None")
        if hasattr(model, "check_context"):
            model.check_context(context)
        if async_scheduling:
            refuse_conflicts(context=context, record_logits=bool(record_logits))
        if tp is not None and tp.size > 1:
            # Lockstep (docs/SEMANTICS.md §18): the settings that steer scheduling and sampling
            # must be equal on every rank, else every rank raises alike.
            self._agreement([], dict(seed=seed, cuda_graphs=bool(cuda_graphs),
                                     enable_chunked_prefill=bool(enable_chunked_prefill),
                                     async_scheduling=bool(async_scheduling)))
        self.model = model
        self.context = context
        self.scheduler = Scheduler(context, enable_chunked_prefill=enable_chunked_prefill)
        self.default_termination_id = default_termination_id
        self.record_logits = record_logits
        self.step_callback = step_callback
        self.step_count = 0
        self.stats = EngineStats(history=deque(maxlen=history_window))
        self.vocab_size = vocab_limit(getattr(model, "vocab_size", None),
                                      getattr(context, "vocab_size", None))
        self._rng = np.random.default_rng(seed)
        self._entries: Dict[int, _Entry] = {}
        self._undelivered: List[RequestResult] = []
        self._suspended = False
        self._next_request_id = 0
        self._overlap = AsyncScheduling(self) if async_scheduling else None
        # The forward mode the graphs capture: every token's logits when the context checks
        # logits (``_forward``), else last-token logits; steps in the other mode run eagerly.
        self.graph_runner = make_graph_runner(model, context,
                                        last_token_only=not self._checks_logits()) \
            if cuda_graphs else None
        if self.graph_runner is not None:
            self.graph_runner.capture_all()

    @classmethod
    def from_transformers(cls, hf_model: Any, *, rope: str = "table",
                          attention_backend: str = "auto", enable_chunked_prefill: bool = True,
                          seed: int = 0, record_logits: bool = False,
                          step_callback: Optional[StepCallback] = None,
                          history_window: Optional[int] = DEFAULT_HISTORY_WINDOW,
                          cuda_graphs: bool = True, async_scheduling: bool = False,
                          enable_prefix_caching: bool = False,
                          prefix_caching_eviction_policy: str = "ref_zero",
                          integration: str = "auto", **context_kwargs: Any) -> "Engine":
        """Build the adapter for a ``transformers`` causal LM and a context sized for it: the
        dedicated one of its class (Llama, DeepSeek-V2/V3, NemotronH), else the generic path
        that runs the model's own code through transformers' attention seam
        (``models/generic.py``); ``engine.model.path`` says which (``"dedicated"`` or
        ``"generic"``); ``integration="generic"`` takes the generic path for a model with a
        dedicated adapter too. A model the generic path cannot run raises
        ``NotImplementedError`` naming it and what it lacks.

        ``context_kwargs`` go to ``DynamicInferenceContext`` (``buffer_size_gb``,
        ``block_size_tokens``, ``max_tokens``, ``params_dtype``, ``device``,
        ``paused_buffer_size_gb``, ``kernel_backend``, ...). Defaults come from the model:
        ``params_dtype`` and ``device`` of its weights, ``num_layers``, ``kv_channels`` =
        head_dim, ``num_attention_heads`` = ``num_key_value_heads``, ``max_sequence_length`` =
        ``max_position_embeddings``; ``buffer_size_gb`` defaults to 1. ``max_requests`` defaults
        to the context's (about one block per request), capped at ``max_tokens``.
        ``num_cuda_graphs`` (a context argument) with ``cuda_graphs=True``: the engine captures
        and replays the forward per graph batch dimension (``Engine``'s ``cuda_graphs``), and
        ``attention_backend="auto"`` picks among the backends a graph can capture
        (``engine.graphs.graph_attention_backend``). ``enable_prefix_caching`` and
        ``prefix_caching_eviction_policy`` (and ``prefix_caching_mamba_gb``, a context
        argument) turn prefix caching on (docs/SEMANTICS.md §17); ``stats.prefix_cache`` then
        gives its counters and hit rates. ``async_scheduling``: as ``Engine``'s.
        ``tensor_model_parallel_size=N`` (a context argument; the group is ``pg_collection.tp``
        or the default ``torch.distributed`` group of N ranks): run one process per rank, as
        under ``torchrun``; each takes its shard of the weights (``models._common
        .TensorParallel``) and a context of its shard, and every rank must then call the
        engine's methods in the same order: rank 0's requests are broadcast and every rank
        returns the same outputs (docs/SEMANTICS.md §18).
        """
        from dynctx.context.parallel import parallel_groups
        from dynctx.models import TensorParallel

        graphs = bool(cuda_graphs and context_kwargs.get("num_cuda_graphs"))
        build, attention_backend = _adapter_for(hf_model, attention_backend, graphs, integration)
        config = hf_model.config
        param = next(hf_model.parameters())
        kwargs = dict(context_kwargs, enable_prefix_caching=enable_prefix_caching,
                      prefix_caching_eviction_policy=prefix_caching_eviction_policy)
        # Tensor parallelism: this rank's shard of the weights, over the group the context
        # resolves (pg_collection.tp, Megatron-Core's parallel_state, or the default group).
        groups = parallel_groups(
            tensor_model_parallel_size=kwargs.get("tensor_model_parallel_size"),
            pipeline_model_parallel_size=kwargs.get("pipeline_model_parallel_size"),
            pg_collection=kwargs.get("pg_collection"))
        if groups.pp > 1:
            raise NotImplementedError(
                f"pipeline_model_parallel_size={groups.pp}: the engine runs every layer of the "
                "model on every rank; pipeline stages are supported by the context (model code "
                "that owns its stage's layers builds one context per stage), not by the engine")
        tp = TensorParallel.from_group(groups.tp, groups.tp_group)
        if tp.size > 1:
            kwargs["tensor_model_parallel_size"] = tp.size
        device = indexed_device(kwargs.pop("device", None) or param.device)
        dtype = kwargs.pop("params_dtype", None) or param.dtype
        if cuda_graphs and kwargs.get("num_cuda_graphs"):
            block_size = kwargs.get("block_size_tokens") or inspect.signature(
                DynamicInferenceContext).parameters["block_size_tokens"].default
            attention_backend = graph_attention_backend(attention_backend, device, block_size,
                                                        dtype)
        model = build(hf_model, device=device, dtype=dtype, rope=rope,
                      attention_backend=attention_backend,
                      **({"tensor_parallel": tp} if tp.size > 1 else {}))
        kwargs.setdefault("num_layers", model.num_layers)
        kwargs.setdefault("kv_channels", model.head_dim)
        kwargs.setdefault("num_attention_heads",
                          getattr(model, "context_kv_heads", model.num_kv_heads))
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
                rounder = math.lcm(DynamicInferenceContext.REQUEST_ROUNDER, tp.size)
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
                   step_callback=step_callback, history_window=history_window,
                   cuda_graphs=cuda_graphs, async_scheduling=async_scheduling)

    # ------------------------------------------------------------------ submission
    @property
    def enable_chunked_prefill(self) -> bool:
        return self.scheduler.enable_chunked_prefill

    @property
    def waiting(self) -> Deque[int]:
        """Ids of the requests that arrived and wait for admission (the scheduler's queue)."""
        return self.scheduler.waiting

    def new_request_id(self) -> int:
        """A request id not in use in the engine."""
        rid = self._free_ids(1)[0]
        self._next_request_id = rid + 1
        return rid

    def _free_ids(self, count: int) -> List[int]:
        ids, rid = [], self._next_request_id
        while len(ids) < count:
            if not self._id_in_use(rid):
                ids.append(rid)
            rid += 1
        return ids

    def _id_in_use(self, rid: int) -> bool:
        """Queued or running, or finished with its result not yet returned (O(1) but for
        the few undelivered results)."""
        return (rid in self._entries or any(r.request_id == rid for r in self._undelivered)
                or (self._overlap is not None and rid in self._overlap.retired))

    def add_request(self, request: DynamicInferenceRequest,
                    arrival_step: Optional[int] = None) -> None:
        """Queue a request; it reaches the waiting queue at engine step ``arrival_step`` (default:
        now; an earlier step means now). The engine keeps its own copy. O(log n).

        Raises ``TypeError``/``ValueError`` before anything changes when an argument is bad: the
        request id (an int in [0, 2**31), not in use), the prompt (non-empty integer ids in
        [0, vocabulary)), the sampling parameters (each within the context's limits) or
        ``arrival_step`` (an int >= 0). Requests that can never run (too long for
        ``max_sequence_length``, for the active KV budget, or for ``max_tokens`` without chunked
        prefill) finish at the next step with ``finish_reason="error"``.
        """
        request, arrival_step = self._from_first_rank(request, arrival_step)
        own = self._check_request(request, "request")
        self._enqueue(own, self._arrival(arrival_step, "arrival_step"))

    def _from_first_rank(self, *values: Any) -> tuple:
        """``values`` as the tensor-parallel group's first rank passed them (one
        ``broadcast_object_list``); unchanged without tensor parallelism. Every rank calls the
        same engine methods in the same order (lockstep, as under ``torchrun``); the requests
        are rank 0's, and since every rank then runs the same deterministic scheduling,
        bookkeeping and sampling on the same logits (the model all-reduces), every rank
        returns the same outputs."""
        tp = getattr(self.model, "tp", None)
        if tp is None or tp.size == 1:
            return values
        import torch.distributed as dist

        # The first rank pickles first: an argument that cannot be sent (a generator, a lambda)
        # is reported to every rank, which all raise the same error, instead of leaving the
        # other ranks waiting in the broadcast.
        payload: Any = None
        first = dist.get_rank(tp.group) == 0
        if first:
            try:
                payload = ("ok", pickle.dumps(values))
            except Exception as error:  # noqa: BLE001 - raised on every rank below
                payload = ("error", f"{type(error).__name__}: {error}")
        box = [payload]
        dist.broadcast_object_list(box, src=dist.get_global_rank(tp.group, 0), group=tp.group)
        kind, data = box[0]
        if kind == "error":
            raise TypeError("the arguments of tensor-parallel rank 0 cannot be sent to the other "
                            f"ranks ({data}); pass lists, tensors and dataclasses (what pickle "
                            "can copy)")
        return values if first else pickle.loads(data)

    def _check_request(self, request: Any, name: str) -> DynamicInferenceRequest:
        metadata_types = getattr(self.context, "request_metadata_types", None) \
            or DynamicInferenceRequest.get_metadata_types()
        own = checked_request(request, name, vocab=self.vocab_size, metadata_types=metadata_types)
        if self._id_in_use(own.request_id):
            raise ValueError(f"{name}.request_id={own.request_id} is already in use in the "
                             "engine (queued, running, or finished and not yet returned)")
        return own

    def _arrival(self, arrival_step: Any, name: str) -> int:
        if arrival_step is None:
            return self.step_count
        return max(check_int(name, arrival_step, low=0), self.step_count)

    def _enqueue(self, request: DynamicInferenceRequest, arrival: int) -> None:
        entry = _Entry(request=request, arrival_step=arrival)
        self._entries[request.request_id] = entry
        error = self._never_fits(request)
        if error is not None:
            self._finish(entry, "error", time.perf_counter(), error=error)
            return
        self.scheduler.submit(request.request_id, arrival)

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

    def unfinished_request_ids(self) -> List[int]:
        """Ids of the requests queued (pending arrival or waiting) or running, sorted."""
        return sorted(self._entries)

    @property
    def undelivered_results(self) -> List[RequestResult]:
        """Finished results not yet returned by a completed ``step()`` (after a step whose
        callback or metrics writer raised, or a batch call that raised); the next ``step()``
        returns them."""
        return list(self._undelivered)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or finished results not yet returned by a step."""
        return bool(self._undelivered or self.scheduler.has_work()
                    or (self._overlap is not None and (self._overlap.pending is not None
                                                       or self._overlap.carried_tokens))
                    or (not self._suspended and self.context.has_unfinished_requests()))

    # ------------------------------------------------------------------ the step
    def step(self) -> StepResult:
        """Run one engine step (see the module docstring) and return what it did.

        ``finished`` lists the requests that finished in this step, and those an earlier step
        finished but could not return because its ``step_callback`` or the context's
        ``metrics_writer`` raised: such an error propagates once the step is complete (the
        engine and the context agree), and its results come with the next step.
        """
        self._refuse_while_suspended("step")
        started = time.perf_counter()
        result = StepResult(step=self.step_count)
        with self._deferred_metrics() as writer:
            if self._overlap is not None:
                self._overlap.step(result)  # engine/overlap.py
            else:
                self._admit()
                if self.context.active_token_count == 0:
                    self._idle(result)
                else:
                    batch = self._forward(result)
                    rows = self._outcomes(batch)
                    self._update(batch, rows, result)
        return self._finish_step(result, started, writer.error if writer else None)

    def _refuse_while_suspended(self, what: str) -> None:
        if self._suspended:
            raise RuntimeError(f"{what}: the engine is suspended; call resume() first")

    @contextlib.contextmanager
    def _deferred_metrics(self) -> Iterator[Optional[_DeferredWriter]]:
        ctx = self.context
        writer = getattr(ctx, "metrics_writer", None)
        if writer is None:
            yield None
            return
        deferred = _DeferredWriter(writer)
        ctx.metrics_writer = deferred
        try:
            yield deferred
        finally:
            ctx.metrics_writer = writer

    def _admit(self) -> None:
        """Release arrivals and schedule; refused requests finish with an error."""
        now = time.perf_counter()
        for rid in self.scheduler.release(self.step_count):
            self._entries[rid].arrival_time = now
        schedule = self.scheduler.schedule(self._live_request)
        for admission in schedule.admitted:
            self._note_admission(admission)
        for rid, error in schedule.refused:
            self._finish(self._entries[rid], "error", now,
                         error=f"the context refused the request: {error}")

    def _live_request(self, rid: int) -> DynamicInferenceRequest:
        """What the context gets for request ``rid``: a checkpoint (prompt + tokens generated
        before an eviction or suspend), created when it is first scheduled."""
        entry = self._entries[rid]
        if entry.live is None:
            entry.live = entry.request.checkpoint()
        return entry.live

    def _note_admission(self, admission: Admission) -> None:
        entry = self._entries[admission.request_id]
        if entry.first_scheduled_step is None:
            entry.first_scheduled_step = self.step_count
        if admission.continuation or not admission.final:
            entry.num_prefill_chunks += 1
            self.stats.prefill_chunks += 1
            if not admission.continuation:
                self.stats.chunked_prefills += 1

    def _idle(self, result: StepResult) -> None:
        """No request can run: skip ahead to the next arrival. A waiting request that the
        scheduler cannot add even to an empty context (none should be: the checks at
        submission and the scheduler's chunking cover every case known) finishes with an
        error, so that the others go on."""
        if self.scheduler.waiting:
            rid = self.scheduler.waiting[0]
            request = self._live_request(rid)
            self.scheduler.discard(rid)
            self._finish(self._entries[rid], "error", time.perf_counter(), error=(
                f"the scheduler cannot add the request even to an empty context "
                f"({request.remaining_prompt_length} prompt tokens to compute, max_tokens="
                f"{self.context.max_tokens}, check_availability="
                f"{tuple(self.context.check_availability(request))}, enable_chunked_prefill="
                f"{self.enable_chunked_prefill}); please report it"))
        result.idle = True
        self.stats.idle_steps += 1
        next_arrival = self.scheduler.next_arrival_step
        self.step_count = max(self.step_count + 1, next_arrival or 0)

    def _forward(self, result: StepResult, read_tokens: bool = True) -> _Batch:
        """``initialize_attention_state``, the model's forward, the logits check, sampling and
        the log probs asked for; ``read_tokens=False`` (async scheduling) leaves the sampled
        tokens on the device (``batch.tokens`` empty)."""
        ctx = self.context
        ctx.initialize_attention_state()
        P, T = ctx.paused_request_count, ctx.total_request_count
        entries = [self._entry(int(i)) for i in ctx.host_request_ids()[P:T]]
        num_decode = ctx.num_decode_requests
        result.active_requests, result.paused_requests = T - P, P
        result.tokens = ctx.active_token_count
        result.kv_utilization = ctx.get_kvcache_utilization_stats()["allocated_utilization"]
        want_prompt_lp = any(e.wants_prompt_log_probs for e in entries[num_decode:])
        # Every token's logits also when the context checks logits (vocab_size, validate): the
        # model's last-token path picks hidden-state rows through ``last_token_logits``, whose
        # checks are meant for logits.
        full = want_prompt_lp or self._checks_logits()
        forward_start = time.perf_counter()
        if self.graph_runner is not None:
            output = self.graph_runner.run(last_token_only=not full)
        else:
            output = self.model.forward(ctx, last_token_only=not full)
        failed = self._nonfinite_rows(output, full, len(entries))
        if failed:
            # The failed rows finish with an error; zeros keep NaN out of sampling.
            output = torch.nan_to_num(output, nan=0.0, posinf=0.0, neginf=float("-inf"))
        last = ctx.last_token_logits(output) if full else output
        overlap = self._overlap
        if overlap is None:
            params = [e.params for e in entries]
            indices = [len(e.request.generated_tokens) for e in entries]
        else:
            params = [overlap.params_for(e) for e in entries]
            indices = [overlap.token_index(e) for e in entries]
        sampled = sample(last, params, indices, self._rng)
        batch = _Batch(entries=entries, num_decode=num_decode,
                       chunked_id=ctx.chunked_prefill_request_id, sampled=sampled,
                       tokens=sampled.tolist() if read_tokens else [], failed=failed,
                       want_prompt_log_probs=want_prompt_lp)
        if any(e.params.return_log_probs for e in entries):
            if want_prompt_lp:
                batch.log_prob_lists, batch.full_log_probs = ctx.calculate_log_probs(
                    output, sampled)
            elif overlap is not None:
                batch.deferred_log_probs = overlap.generated_log_probs(last, sampled)
            else:
                batch.log_prob_lists, batch.full_log_probs = ctx.calculate_log_probs(
                    last, sampled, only_last_token_logits=True)
        if self.record_logits:
            prefix = ctx.active_attn_metadata.kv_seq_lengths[:T - P].tolist()
            rows = last.float().cpu()
            for i, entry in enumerate(entries):
                entry.step_logits.append((int(prefix[i]), rows[i].clone()))
        self.stats.forward_time_s += time.perf_counter() - forward_start
        return batch

    def _entry(self, rid: int) -> _Entry:
        """The entry of a request in the context (running, or retired in async mode)."""
        entry = self._entries.get(rid)
        if entry is None and self._overlap is not None:
            entry = self._overlap.retired.get(rid)
        if entry is None:
            raise KeyError(f"internal: request {rid} is in the context but not in the engine")
        return entry

    @property
    def async_scheduling(self) -> bool:
        return self._overlap is not None

    @property
    def async_scheduling_counts(self) -> Dict[str, int]:
        """Async scheduling's counters (``engine/overlap.py``, ``AsyncScheduling.counts``);
        empty when it is off."""
        return {} if self._overlap is None else dict(self._overlap.counts)

    @property
    def graph_replays(self) -> int:
        """Forward steps that replayed a captured graph (0 without graphs)."""
        runner = self.graph_runner
        return 0 if runner is None else sum(runner.replays.values())

    def _checks_logits(self) -> bool:
        """The context checks logits (``vocab_size`` or ``validate``): the model then gives
        every token's logits."""
        ctx = self.context
        return getattr(ctx, "vocab_size", None) is not None or bool(getattr(ctx, "validate", False))

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

    def _outcomes(self, batch: _Batch) -> List[_Row]:
        """Each active row's token, finish and log probs; changes nothing."""
        rows: List[_Row] = []
        cache: Dict[str, Any] = {}
        for i, (entry, token) in enumerate(zip(batch.entries, batch.tokens)):
            row = _Row(entry)
            rows.append(row)
            if i in batch.failed:
                row.finish, row.error = "error", batch.failed[i]
                continue
            is_chunk = entry.request_id == batch.chunked_id
            self._row_log_probs(row, i, batch, cache)
            if is_chunk:
                continue  # a non-final chunk: its sample is junk, the context keeps it
            row.token = token
            row.finish = finish_reason(entry.params, token,
                                       len(entry.request.generated_tokens) + 1)
        return rows

    def _row_log_probs(self, row: _Row, i: int, batch: _Batch, cache: Dict[str, Any]) -> None:
        """Row ``i``'s prompt and generated log probs, when its request asks for them
        (``cache`` keeps the step's ``cu_query_seq_lengths`` once read)."""
        entry = row.entry
        if batch.log_prob_lists is None or not entry.params.return_log_probs:
            return
        is_chunk = entry.request_id == batch.chunked_id
        values = batch.log_prob_lists[i]
        if entry.wants_prompt_log_probs and i >= batch.num_decode and batch.want_prompt_log_probs:
            row.prompt_log_probs = list(values[:-1])
            if is_chunk:
                # The chunk's last position predicts the next chunk's first token.
                if "cu_query" not in cache:
                    cache["cu_query"] = self.context.active_attn_metadata \
                        .cu_query_seq_lengths.tolist()
                cu_query = cache["cu_query"]
                next_token = int(entry.live.remaining_prompt_tokens[0])
                row.prompt_log_probs.append(
                    float(batch.full_log_probs[cu_query[i + 1] - 1, next_token]))
        if not is_chunk:
            row.generated_log_prob = values[-1]

    def _update(self, batch: _Batch, rows: List[_Row], result: StepResult) -> None:
        """``update_requests`` with the rows' mask, then the rows applied to the engine."""
        ctx = self.context
        if batch.chunked_id != -1 and any(r.finish == "error" and r.entry.request_id ==
                                          batch.chunked_id for r in rows):
            # A chunked prefill that failed ends now: the mask releases it like any other.
            ctx.chunked_prefill_request_id = -1
            self.scheduler.discard(batch.chunked_id)
        mask = torch.tensor([r.keep for r in rows], dtype=torch.bool, device=ctx.device)
        paused = ctx.update_requests(mask, batch.sampled)
        result.paused_ids = [int(i) for i in paused.tolist()]
        result.evicted_ids = [int(i) for i in ctx.evicted_request_ids.tolist()]
        now = time.perf_counter()
        for row in rows:
            self._apply(row, result, now)
        self._after_update(result)

    def _after_update(self, result: StepResult) -> None:
        """The engine's side of an update whose ``result.paused_ids`` and
        ``result.evicted_ids`` are set: pause and eviction counts, the evicted requests
        re-queued for recompute, the step counted and closed."""
        for rid in result.paused_ids:
            self._entries[rid].num_pauses += 1
        for rid in result.evicted_ids:
            entry = self._entries[rid]
            entry.live, entry.recompute = None, True
            entry.num_evictions += 1
        self.scheduler.after_update(result.evicted_ids)
        self._count(result)
        self.step_count += 1

    @staticmethod
    def _apply_log_probs(row: _Row) -> None:
        """The row's prompt and generated log probs join its request's."""
        entry = row.entry
        entry.prompt_log_probs.extend(row.prompt_log_probs)
        if row.generated_log_prob is not None:
            entry.generated_log_probs.append(row.generated_log_prob)

    def _apply(self, row: _Row, result: StepResult, now: float) -> None:
        entry = row.entry
        self._apply_log_probs(row)
        if row.token is not None:
            entry.request.generated_tokens.append(row.token)
            result.new_tokens[entry.request_id] = row.token
            if entry.first_token_step is None:
                entry.first_token_step, entry.first_token_time = self.step_count, now
        if row.finish is not None:
            self._finish(entry, row.finish, now, error=row.error)

    def _count(self, result: StepResult) -> None:
        stats = self.stats
        stats.forward_steps += 1
        stats.tokens_processed += result.tokens
        stats.generated_tokens += len(result.new_tokens)
        stats.pauses += len(result.paused_ids)
        stats.evictions += len(result.evicted_ids)
        stats.peak_kv_utilization = max(stats.peak_kv_utilization, result.kv_utilization)
        if getattr(self.context, "prefix_cache", None) is not None:
            stats.prefix_cache = self.context.get_prefix_cache_stats()
        stats.peak_active_requests = max(stats.peak_active_requests, result.active_requests)
        stats.peak_paused_requests = max(stats.peak_paused_requests,
                                         self.context.paused_request_count,
                                         result.paused_requests)

    def _finish_step(self, result: StepResult, started: float,
                     deferred: Optional[BaseException]) -> StepResult:
        """Hand the undelivered results over, record the step, call the callback; an error of
        the callback or the metrics writer propagates with the results kept undelivered."""
        result.time_s = time.perf_counter() - started
        result.finished = list(self._undelivered)
        if self.stats.history.maxlen != 0:
            self.stats.history.append(replace(result, new_tokens={}, finished=[]))
        if self.step_callback is not None:
            try:
                self.step_callback(result)
            except BaseException as error:
                if deferred is not None and error.__context__ is None:
                    error.__context__ = deferred  # the metrics writer raised first
                raise
        if deferred is not None:
            raise deferred
        # Only what this step delivered: a result finished inside the callback (a suspend that
        # reads the tokens in flight, a request added that can never run) waits for the next.
        del self._undelivered[:len(result.finished)]
        return result

    def _finish(self, entry: _Entry, reason: str, now: float,
                error: Optional[str] = None, step: Optional[int] = None) -> None:
        """The request's result joins the undelivered ones; the engine forgets the request.
        ``step``: the step that sampled its last token (default: this one)."""
        del self._entries[entry.request_id]
        request = entry.request
        params = request.sampling_params
        if reason == "error":
            self.stats.errors += 1
        self._undelivered.append(RequestResult(
            request_id=entry.request_id, prompt_tokens=request.prompt_tokens.tolist(),
            generated_tokens=list(request.generated_tokens), finish_reason=reason, error=error,
            generated_log_probs=list(entry.generated_log_probs) if params.return_log_probs
            else None,
            prompt_log_probs=list(entry.prompt_log_probs)
            if params.return_log_probs and not params.skip_prompt_log_probs else None,
            arrival_step=entry.arrival_step, first_scheduled_step=entry.first_scheduled_step,
            first_token_step=entry.first_token_step,
            finish_step=self.step_count if step is None else step,
            arrival_time=entry.arrival_time, first_token_time=entry.first_token_time,
            finish_time=now, num_pauses=entry.num_pauses, num_evictions=entry.num_evictions,
            num_prefill_chunks=entry.num_prefill_chunks,
            step_logits=list(entry.step_logits) if self.record_logits else None))

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
        if self._overlap is not None:
            # The tokens in flight are read first (the checkpoints hold them); retired requests
            # have finished and are not re-queued.
            retired = set(self._overlap.before_suspend())
            ids = [rid for rid in ids if rid not in retired]
        for rid in ids:
            entry = self._entries[rid]
            entry.live = None
            if entry.request.generated_tokens:
                entry.recompute = True
            else:
                # The prompt runs again from its start: its prompt log probs too.
                entry.prompt_log_probs.clear()
        self.scheduler.requeue_suspended(ids)
        if self.graph_runner is not None:
            self.graph_runner.release()  # they read the tensors freed now
        ctx.deallocate_all_tensors()
        self._suspended = True
        self.stats.suspends += 1

    def resume(self) -> None:
        """Re-allocate the context's tensors and capture the CUDA graphs again (the tensors
        have new addresses); the next steps re-add the suspended requests."""
        if not self._suspended:
            return
        self.context.allocate_all_tensors(is_init=False)
        if self.graph_runner is not None:
            self.graph_runner.capture_all()
        self._suspended = False

    # ------------------------------------------------------------------ batch APIs
    def run(self) -> List[RequestResult]:
        """Step until every queued request has finished; return them in finishing order. When
        a step raises, the results collected so far go back to the engine (the next ``step``
        or ``run`` returns them)."""
        results: List[RequestResult] = []
        try:
            while self.has_unfinished_requests():
                results.extend(self.step().finished)
        except BaseException:
            self._undelivered[:0] = results
            raise
        return results

    def generate_requests(self, requests: Sequence[DynamicInferenceRequest],
                          arrival_steps: Optional[Sequence[int]] = None) -> List[RequestResult]:
        """Run ``requests`` (request ``i`` reaches the queue ``arrival_steps[i]`` steps from
        now) to completion; returns their results in the order given.

        Every request and arrival step is checked before any is queued (``add_request``'s
        checks, ids unique, ``arrival_steps[i]`` an int >= 0; not while suspended). Results of
        other requests that finish meanwhile are kept for the next ``step``/``run``; when a
        step raises, so are the results collected so far.
        """
        self._refuse_while_suspended("generate_requests")
        requests, arrival_steps = self._from_first_rank(requests, arrival_steps)
        checked = self._check_batch(requests, arrival_steps)
        for request, arrival in checked:
            self._enqueue(request, arrival)
        return self._collect([request.request_id for request, _ in checked])

    def _check_batch(self, requests: Any, arrival_steps: Any) -> List[tuple]:
        """``(own copy, arrival step)`` per request, or the first error; changes nothing."""
        if isinstance(requests, DynamicInferenceRequest):
            raise TypeError("requests is one DynamicInferenceRequest; give a list of them "
                            "(e.g. [request])")
        requests = list(requests)
        if arrival_steps is None:
            delays = [0] * len(requests)
        else:
            delays = list(arrival_steps)
            if len(delays) != len(requests):
                raise ValueError(f"arrival_steps has {len(delays)} entries for "
                                 f"{len(requests)} requests")
            delays = [check_int(f"arrival_steps[{i}]", d, low=0) for i, d in enumerate(delays)]
        first_index: Dict[int, int] = {}
        checked = []
        for i, (request, delay) in enumerate(zip(requests, delays)):
            own = self._check_request(request, f"requests[{i}]")
            if own.request_id in first_index:
                raise ValueError(f"requests[{i}].request_id={own.request_id} repeats "
                                 f"requests[{first_index[own.request_id]}]; ids must be unique")
            first_index[own.request_id] = i
            checked.append((own, self.step_count + delay))
        return checked

    def _collect(self, ids: List[int]) -> List[RequestResult]:
        """Step until every request of ``ids`` has finished; their results in that order."""
        wanted = set(ids)
        seen: List[RequestResult] = []
        got: Dict[int, RequestResult] = {}
        try:
            while len(got) < len(wanted):
                if not self.has_unfinished_requests():
                    raise RuntimeError("internal: the engine ran out of work with requests "
                                       f"{sorted(wanted - got.keys())} unfinished")
                for finished in self.step().finished:
                    seen.append(finished)
                    if finished.request_id in wanted:
                        got[finished.request_id] = finished
        except BaseException:
            self._undelivered[:0] = seen
            raise
        self._undelivered[:0] = [r for r in seen if r.request_id not in wanted]
        return [got[i] for i in ids]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16,
                 arrival_steps: Optional[Sequence[int]] = None,
                 sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
                 termination_id: Optional[int] = None,
                 ignore_eos: bool = False) -> List[List[int]]:
        """Generate for token-id prompts; ``outputs[i]`` lists the ids generated for
        ``prompts[i]``.

        ``prompts`` is a list of prompts, each a list (or 1-D tensor) of token ids in
        [0, vocabulary); every argument is checked, naming ``prompts[i]``, before anything is
        queued. Greedy unless ``sampling_params`` (one for all, or one per prompt) are given;
        their ``num_tokens_to_generate`` is replaced by ``max_new_tokens``. Generation stops at
        ``termination_id`` (default: the model's EOS id, as ``transformers.generate`` does;
        ``ignore_eos=True``: never) or after ``max_new_tokens`` tokens. A request that cannot
        run raises ``RuntimeError`` once all have finished; its ``results`` attribute holds
        every prompt's ``RequestResult``.
        """
        self._refuse_while_suspended("generate")
        (prompts, max_new_tokens, arrival_steps, sampling_params, termination_id,
         ignore_eos) = self._from_first_rank(prompts, max_new_tokens, arrival_steps,
                                             sampling_params, termination_id, ignore_eos)
        prompts = check_prompts(prompts)
        tensors = [prompt_tensor(p, f"prompts[{i}]", self.vocab_size)
                   for i, p in enumerate(prompts)]
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1)
        if termination_id is not None:
            termination_id = check_int("termination_id", termination_id,
                                       low=-2 ** 63, high=2 ** 63 - 1)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos={ignore_eos!r} must be a bool")
        metadata_types = getattr(self.context, "request_metadata_types", None) \
            or DynamicInferenceRequest.get_metadata_types()
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            base = sampling_params or SamplingParams(temperature=1.0, top_k=1)
            per_prompt = [check_sampling_params(base, "sampling_params", metadata_types)] \
                * len(prompts)
        else:
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
            per_prompt = [check_sampling_params(p, f"sampling_params[{i}]", metadata_types)
                          for i, p in enumerate(per_prompt)]
        stop = None if ignore_eos else (
            termination_id if termination_id is not None else self.default_termination_id)
        requests = []
        for prompt, params, rid in zip(tensors, per_prompt, self._free_ids(len(prompts))):
            params = copy.deepcopy(params)
            params.num_tokens_to_generate = max_new_tokens
            params.num_tokens_total = None
            if termination_id is not None or ignore_eos or params.termination_id is None:
                params.termination_id = stop
            requests.append(DynamicInferenceRequest(request_id=rid, prompt_tokens=prompt,
                                                    sampling_params=params))
        checked = self._check_batch(requests, arrival_steps)
        if requests:
            self._next_request_id = requests[-1].request_id + 1
        for request, arrival in checked:
            self._enqueue(request, arrival)
        results = self._collect([request.request_id for request, _ in checked])
        errors = [f"prompt {i}: {r.error}" for i, r in enumerate(results)
                  if r.finish_reason == "error"]
        if errors:
            error = RuntimeError("generate: " + "; ".join(errors))
            error.results = results
            raise error
        return [r.generated_tokens for r in results]
