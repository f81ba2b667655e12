"""A small reference engine: in-flight batching over a ``DynamicInferenceContext``.

One ``step()`` does what Megatron-Core's ``DynamicInferenceEngine`` step does (docs/SEMANTICS.md
§10, §11): admit requests (arrivals, FIFO admission, chunked prefill: ``Scheduler`` in
``engine/scheduler.py``); ``initialize_attention_state``; the model's forward; per-request
sampling; the finish mask; ``update_requests``; re-queue evicted requests at the front for
recompute; return the finished requests. With ``async_scheduling=True`` the sampled tokens are
read one step late, after the next step's forward is launched (``engine/overlap.py``).

``Engine`` is the facade over parts that each own one job (docs/DESIGN.md §3):

* ``engine/build.py``: construction from ``transformers`` (adapter, sizes, context);
* ``engine/intake.py``: request ids, the checks against the context's limits, the queue;
* ``engine/scheduler.py``: admission (FIFO, chunked prefill, re-queueing);
* ``engine/step.py``: the step (forward, sampling, the finish mask, ``update_requests``);
* ``engine/overlap.py``: the same pieces with the tokens read one step late;
* ``engine/results.py``: finished results and their delivery, for both modes;
* ``engine/graphs.py``: CUDA graph capture and replay (the runners), over
  ``engine/replay_inputs.py`` (what a replay reads), ``engine/launch_tape.py`` (the CPU
  stand-in's check of every launch) and ``engine/sync_guard.py`` (host syncs refused);
* ``engine/sampling.py``, ``engine/lockstep.py``: sampling, tensor-parallel lockstep.

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
  sampling); without it, one whose last-token logits give sampling no distribution (NaN, all
  ``-inf``, or ``+inf`` under temperature: ``engine/sampling.py``). With the context's
  ``validate`` or ``vocab_size`` set, the model computes every token's logits and the engine
  picks the last-token rows through the context (whose checks are then made on logits; the LM
  head also runs on prefill tokens).
* A ``step_callback`` or the context's ``metrics_writer`` that raises: the step completes first,
  so that the engine and the context agree, and then the error propagates out of ``step()``.
  No result is lost: the finished results of a step that raised stay undelivered, and the next
  ``step()`` returns them (in its ``finished`` list, and to its callback, again). ``run``,
  ``generate_requests`` and ``generate`` likewise hand back, to the next call, the results they
  had collected when a step raised.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

import numpy as np

from dynctx.context import DynamicInferenceContext, DynamicInferenceRequest, SamplingParams
from dynctx.context.parallel import CountAgreement, joins_agreement_on_failure

from .build import build_from_transformers
from .graphs import make_graph_runner
from .intake import Intake
from .lockstep import from_first_rank
from .overlap import AsyncScheduling, refuse_conflicts
from .results import (
    DEFAULT_HISTORY_WINDOW,
    Delivery,
    EngineStats,
    RequestResult,
    StepResult,
    deferred_metrics,
)
from .scheduler import Scheduler
from .speculative_overlap import SpeculativeAsync
from .speculative_step import stepper_for
from .validation import check_bool, check_int, check_model_and_context, vocab_limit

__all__ = ["DEFAULT_HISTORY_WINDOW", "Engine", "EngineStats", "RequestResult", "StepResult"]

StepCallback = Callable[["StepResult"], None]


def check_attention_backend(model: Any, context: DynamicInferenceContext) -> None:
    """Resolve the model's paged attention for ``context`` now (an adapter's
    ``attention_for``), so that a backend that cannot run here raises at construction, naming
    ``attention_backend``, instead of in the first step."""
    attention_for = getattr(model, "attention_for", None)
    if not callable(attention_for):
        return
    try:
        attention_for(context)
    except (ValueError, RuntimeError) as error:
        requested = getattr(model, "attention_backend_request", None)
        raise type(error)(f"attention_backend={requested!r}: {error}") from error


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
        drafter: with a context of ``num_speculative_tokens >= 1``, what proposes the drafts
            (``engine/drafters.py``): required then, refused otherwise.

    Every option is checked here (``TypeError``/``ValueError`` naming it), and the model's
    attention backend is resolved for the context: one that cannot run raises now.
    """

    @joins_agreement_on_failure
    def __init__(self, model: Any, context: DynamicInferenceContext, *,
                 enable_chunked_prefill: bool = True, seed: int = 0,
                 default_termination_id: Optional[int] = None, record_logits: bool = False,
                 step_callback: Optional[StepCallback] = None,
                 history_window: Optional[int] = DEFAULT_HISTORY_WINDOW,
                 cuda_graphs: bool = True, async_scheduling: bool = False,
                 drafter: Any = None):
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            # A rank whose arguments fail below still joins the agreement (as failed), so that
            # every rank raises instead of waiting for it.
            self._agreement = CountAgreement([tp.group], what="build their engines")
        seed = check_int("seed", seed, low=0)
        enable_chunked_prefill = check_bool("enable_chunked_prefill", enable_chunked_prefill)
        record_logits = check_bool("record_logits", record_logits)
        cuda_graphs = check_bool("cuda_graphs", cuda_graphs)
        async_scheduling = check_bool("async_scheduling", async_scheduling)
        if default_termination_id is not None:
            default_termination_id = check_int("default_termination_id", default_termination_id)
        if history_window is not None:
            history_window = check_int("history_window", history_window, low=0)
        if step_callback is not None and not callable(step_callback):
            raise TypeError(f"step_callback={step_callback!r} must be callable or None")
        check_model_and_context(model, context)
        if async_scheduling:
            refuse_conflicts(context=context, record_logits=record_logits)
        check_attention_backend(model, context)
        if tp is not None and tp.size > 1:
            # Lockstep (docs/SEMANTICS.md §18): the settings that steer scheduling and sampling
            # must be equal on every rank, else every rank raises alike.
            self._agreement([], dict(seed=seed, cuda_graphs=cuda_graphs,
                                     enable_chunked_prefill=enable_chunked_prefill,
                                     async_scheduling=async_scheduling,
                                     drafter=None if drafter is None
                                     else type(drafter).__name__))
        self._tp = tp
        self.context = context
        self.default_termination_id = default_termination_id
        self.step_callback = step_callback
        self.stats = EngineStats(history=deque(maxlen=history_window))
        self.scheduler = Scheduler(context, enable_chunked_prefill=enable_chunked_prefill)
        self.vocab_size = vocab_limit(getattr(model, "vocab_size", None),
                                      getattr(context, "vocab_size", None))
        states: Dict[int, Any] = {}
        self._delivery = Delivery(states, self.stats, record_logits=record_logits)
        self._intake = Intake(context, self.scheduler, self._delivery, states,
                              vocab_size=self.vocab_size)
        stepper = stepper_for(context, drafter, async_scheduling=async_scheduling,
                              record_logits=record_logits)
        self._steps = stepper(model=model, context=context, scheduler=self.scheduler,
                              intake=self._intake, delivery=self._delivery, stats=self.stats,
                              rng=np.random.default_rng(seed), record_logits=record_logits)
        self._async = (SpeculativeAsync if drafter is not None else AsyncScheduling)(
            self._steps) if async_scheduling else None
        self._suspended = False
        # The forward mode the graphs capture: every token's logits when the context checks
        # logits, else last-token logits; steps in the other mode run eagerly.
        if cuda_graphs:
            self.graph_runner = make_graph_runner(
                model, context, last_token_only=not self._steps.checks_logits())
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
                          integration: str = "auto", num_speculative_tokens: int = 0,
                          drafter: Any = None, **context_kwargs: Any) -> "Engine":
        """Build the adapter for a ``transformers`` causal LM and a context sized for it
        (``engine/build.py``): the dedicated one of its class (Llama, DeepSeek-V2/V3,
        NemotronH), else the generic path that runs the model's own code through transformers'
        attention seam (``models/generic.py``); ``engine.model.path`` says which
        (``"dedicated"`` or ``"generic"``); ``integration="generic"`` takes the generic path
        for a model with a dedicated adapter too. A model the generic path cannot run raises
        ``NotImplementedError`` naming it and what it lacks.

        ``context_kwargs`` go to ``DynamicInferenceContext`` (``buffer_size_gb``,
        ``block_size_tokens``, ``max_tokens``, ``params_dtype``, ``device``,
        ``paused_buffer_size_gb``, ``kernel_backend``, ``kv_offload_gb``, ...). Defaults
        come from the model:
        ``params_dtype`` and ``device`` of its weights, ``num_layers``, ``kv_channels`` =
        head_dim, ``num_attention_heads`` = ``num_key_value_heads``, ``max_sequence_length`` =
        ``max_position_embeddings``; ``buffer_size_gb`` defaults to 1. ``max_requests`` defaults
        to the context's (about one block per request), capped at ``max_tokens``.
        ``attention_backend``: one of ``dynctx.models.paged_attention.BACKENDS``, checked (and
        resolved for the device) before the engine is returned.
        ``num_cuda_graphs`` (a context argument) with ``cuda_graphs=True``: the engine captures
        and replays the forward per graph batch dimension (``Engine``'s ``cuda_graphs``), and
        ``attention_backend="auto"`` picks among the backends a graph can capture
        (``engine.replay_inputs.graph_attention_backend``). ``enable_prefix_caching`` and
        ``prefix_caching_eviction_policy`` (and ``prefix_caching_mamba_gb``, a context
        argument) turn prefix caching on (docs/SEMANTICS.md §17); ``stats.prefix_cache`` then
        gives its counters and hit rates. ``async_scheduling``: as ``Engine``'s.
        ``tensor_model_parallel_size=N`` (a context argument; the group is ``pg_collection.tp``
        or the default ``torch.distributed`` group of N ranks): run one process per rank, as
        under ``torchrun``; each takes its shard of the weights (``models._common
        .TensorParallel``) and a context of its shard, and every rank must then call the
        engine's methods in the same order: rank 0's requests are broadcast and every rank
        returns the same outputs (docs/SEMANTICS.md §18).
        ``num_speculative_tokens=k`` (1 <= k < ``block_size_tokens``) decodes speculatively:
        ``drafter`` (default ``"ngram"``; a transformers causal LM of the same vocabulary; or an
        object with the drafter interface of ``engine/drafters.py``) proposes up to ``k``
        tokens a step that the model verifies (docs/SEMANTICS.md §19).
        """
        return build_from_transformers(
            cls, hf_model, rope=rope, attention_backend=attention_backend,
            enable_chunked_prefill=enable_chunked_prefill, seed=seed,
            record_logits=record_logits, step_callback=step_callback,
            history_window=history_window, cuda_graphs=cuda_graphs,
            async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching,
            prefix_caching_eviction_policy=prefix_caching_eviction_policy,
            integration=integration, num_speculative_tokens=num_speculative_tokens,
            drafter=drafter, **context_kwargs)

    # ------------------------------------------------------------------ parts and settings
    @property
    def model(self) -> Any:
        """The model adapter the steps run (may be replaced between steps)."""
        return self._steps.model

    @model.setter
    def model(self, model: Any) -> None:
        self._steps.model = model

    @property
    def graph_runner(self) -> Any:
        """The CUDA graph runner (None without graphs; may be replaced between steps)."""
        return self._steps.graph_runner

    @graph_runner.setter
    def graph_runner(self, runner: Any) -> None:
        self._steps.graph_runner = runner

    @property
    def step_count(self) -> int:
        """Engine steps so far (an idle step may skip ahead to the next arrival)."""
        return self._steps.step_count

    @property
    def record_logits(self) -> bool:
        return self._steps.record_logits

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.scheduler.enable_chunked_prefill

    @property
    def waiting(self) -> Deque[int]:
        """Ids of the requests that arrived and wait for admission (the scheduler's queue)."""
        return self.scheduler.waiting

    @property
    def async_scheduling(self) -> bool:
        return self._async is not None

    @property
    def async_scheduling_counts(self) -> Dict[str, int]:
        """Async scheduling's counters (``engine/overlap.py``, ``AsyncScheduling.counts``);
        empty when it is off."""
        return {} if self._async is None else dict(self._async.counts)

    @property
    def graph_replays(self) -> int:
        """Forward steps that replayed a captured graph (0 without graphs)."""
        runner = self.graph_runner
        return 0 if runner is None else sum(runner.replays.values())

    # ------------------------------------------------------------------ submission
    def new_request_id(self) -> int:
        """A request id not in use in the engine."""
        request_id = self._intake.free_ids(1)[0]
        self._intake.claim_through(request_id)
        return request_id

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
        request, arrival_step = from_first_rank(self._tp, request, arrival_step)
        own = self._intake.check_request(request, "request")
        now = self.step_count
        self._intake.enqueue(own, self._intake.arrival(arrival_step, "arrival_step", now), now)

    def unfinished_request_ids(self) -> List[int]:
        """Ids of the requests queued (pending arrival or waiting) or running, sorted."""
        return self._intake.unfinished_ids()

    @property
    def undelivered_results(self) -> List[RequestResult]:
        """Finished results not yet returned by a completed ``step()`` (after a step whose
        callback or metrics writer raised, or a batch call that raised); the next ``step()``
        returns them."""
        return self._delivery.undelivered

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or finished results not yet returned by a step."""
        return bool(self._delivery.has_undelivered() or self.scheduler.has_work()
                    or (self._async is not None and self._async.has_work())
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
        with deferred_metrics(self.context) as writer:
            (self._async or self._steps).step(result)
        return self._delivery.close_step(result, started,
                                         deferred=writer.error if writer else None,
                                         callback=self.step_callback)

    def _refuse_while_suspended(self, what: str) -> None:
        if self._suspended:
            raise RuntimeError(f"{what}: the engine is suspended; call resume() first")

    # ------------------------------------------------------------------ suspend / resume
    @property
    def suspended(self) -> bool:
        return self._suspended

    def suspend(self) -> None:
        """Free the context's tensors; the in-flight requests go back to the front of the
        waiting queue (in row order) and are recomputed after ``resume()`` (restored from
        host memory in ``kv_cache_management_mode="offload"``; ``"persist"`` keeps them)."""
        if self._suspended:
            return
        ctx = self.context
        if getattr(ctx, "kv_cache_management_mode", None) == "persist":
            self._suspended = True   # PERSIST: the context keeps its tensors and requests
            self.stats.suspends += 1
            return
        ids = [int(i) for i in ctx.host_request_ids()[:ctx.total_request_count]]
        if self._async is not None:
            # The tokens in flight are read first (the checkpoints hold them); retired requests
            # have finished and are not re-queued.
            retired = set(self._async.before_suspend())
            ids = [request_id for request_id in ids if request_id not in retired]
        self._intake.suspended(ids)
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
        if getattr(self.context, "kv_cache_management_mode", None) == "persist":
            self._suspended = False
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
            self._delivery.hand_back(results)
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
        requests, arrival_steps = from_first_rank(self._tp, requests, arrival_steps)
        checked = self._intake.check_batch(requests, arrival_steps, self.step_count)
        return self._run_checked(checked)

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
         ignore_eos) = from_first_rank(self._tp, prompts, max_new_tokens, arrival_steps,
                                       sampling_params, termination_id, ignore_eos)
        requests = self._intake.prompt_requests(
            prompts, max_new_tokens=max_new_tokens, sampling_params=sampling_params,
            termination_id=termination_id, ignore_eos=ignore_eos,
            default_termination_id=self.default_termination_id)
        checked = self._intake.check_batch(requests, arrival_steps, self.step_count)
        if requests:
            self._intake.claim_through(requests[-1].request_id)
        results = self._run_checked(checked)
        errors = [f"prompt {i}: {r.error}" for i, r in enumerate(results)
                  if r.finish_reason == "error"]
        if errors:
            error = RuntimeError("generate: " + "; ".join(errors))
            error.results = results
            raise error
        return [r.generated_tokens for r in results]

    def _run_checked(self, checked: List[tuple]) -> List[RequestResult]:
        """Queue the checked ``(request, arrival)`` pairs and step until each has finished;
        their results in that order. Other requests' results are kept for the next step."""
        now = self.step_count
        for request, arrival in checked:
            self._intake.enqueue(request, arrival, now)
        ids = [request.request_id for request, _ in checked]
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
            self._delivery.hand_back(seen)
            raise
        self._delivery.hand_back([r for r in seen if r.request_id not in wanted])
        return [got[i] for i in ids]
