"""Construction from ``transformers``: the model adapter, a context sized for it, the engine.

``build_from_transformers`` is ``Engine.from_transformers`` (its docstring says what each
argument does). It checks the engine's own options first, picks the adapter by the model's
class, else the generic path (``transformers_adapter``), and decides the context's sizes by
computing them: the context's default ``max_requests`` (about one per KV block,
``context/sizing.py``) is capped at ``max_tokens`` when it would exceed it.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from dynctx.context import DynamicInferenceContext, kv_group_sizing
from dynctx.context import sizing as context_sizing
from dynctx.context.kv_scales import resolve_kv_cache_dtype
from dynctx.context.parallel import parallel_groups
from dynctx.kernels.backend import HAS_TRITON
from dynctx.kernels.devices import indexed_device
from dynctx.models.paged_attention import BACKENDS as ATTENTION_BACKENDS

from .replay_inputs import graph_attention_backend
from .validation import check_choice


def transformers_adapters() -> Dict[str, Callable[..., Any]]:
    """The dedicated adapters by model class; every other model takes the generic path."""
    from dynctx.models import DeepseekV2Adapter, LlamaAdapter, NemotronHAdapter

    return {"NemotronHForCausalLM": NemotronHAdapter.from_transformers,
            "LlamaForCausalLM": LlamaAdapter.from_transformers,
            "DeepseekV2ForCausalLM": DeepseekV2Adapter.from_transformers,
            "DeepseekV3ForCausalLM": DeepseekV2Adapter.from_transformers}


INTEGRATIONS = ("auto", "generic")


def transformers_adapter(hf_model: Any, attention_backend: str, graphs: bool,
                         integration: str = "auto") -> tuple:
    """``(build, attention_backend)``: the dedicated adapter of ``hf_model``'s class (unless
    ``integration="generic"``), else the generic transformers path (``models/generic.py``),
    whose ``"auto"`` attention with CUDA graphs is the padded torch version when the model has
    windows or sinks and Triton is not installed (flash-attn, the other graph fallback, has
    neither)."""
    from dynctx.models import GenericAdapter

    if integration not in INTEGRATIONS:
        raise ValueError(f"integration={integration!r} must be one of {INTEGRATIONS}")
    adapters = transformers_adapters()
    name = type(hf_model).__name__
    if name in adapters and integration == "auto":
        return adapters[name], attention_backend
    if graphs and attention_backend == "auto" and not HAS_TRITON \
            and GenericAdapter.needs_window_backend(hf_model):
        attention_backend = "torch_static"
    return GenericAdapter.from_transformers, attention_backend


def _context_default(name: str) -> Any:
    return inspect.signature(DynamicInferenceContext).parameters[name].default


def derived_max_requests(kwargs: Dict[str, Any], tp: int) -> Optional[int]:
    """The ``max_requests`` the context would derive from ``kwargs`` (its constructor's
    arguments, ``max_requests`` not given), computed by the context's own sizing without
    allocating; None when the arguments do not size (the context then raises its own error)."""
    get = kwargs.get
    try:
        dtype = get("params_dtype")
        layers = context_sizing.layer_layout(get("num_layers"),
                                             get("mamba_inference_state_config"), dtype)
        block_size = get("block_size_tokens", _context_default("block_size_tokens"))
        # KV groups whose every layer is windowed derive it from their windows' worst cases.
        spec = None if get("kv_groups", True) is False else kv_group_sizing.window_groups(
            kv_group_sizing.check_layer_windows(get("kv_layer_windows"),
                                                layers.num_attention_layers),
            get("max_sequence_length"))
        rule = kv_group_sizing.windowed_requests_rule(
            spec, block_size=block_size,
            max_tokens=get("max_tokens") or DynamicInferenceContext.DEFAULT_MAX_TOKENS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the context warns when it is built
            layout = context_sizing.memory_layout(
                layers=layers, kv_dtype=resolve_kv_cache_dtype(get("kv_cache_dtype"), dtype),
                block_size_tokens=block_size,
                heads_per_partition=max(1, get("num_attention_heads") // tp),
                kv_channels=get("kv_channels"),
                cache_mla_latent=bool(get("cache_mla_latent", False)),
                kv_lora_rank=get("kv_lora_rank"), qk_pos_emb_head_dim=get("qk_pos_emb_head_dim"),
                unified_memory_level=get("unified_memory_level",
                                         _context_default("unified_memory_level")),
                device=indexed_device(get("device")), buffer_size_gb=get("buffer_size_gb"),
                paused_buffer_size_gb=get("paused_buffer_size_gb"), max_requests=None,
                # No token budget binds here: the derived count is what is asked for.
                max_tokens=2 ** 62, default_max_tokens=2 ** 62,
                max_sequence_length=get("max_sequence_length"), tp=tp,
                request_rounder=DynamicInferenceContext.REQUEST_ROUNDER, derive_requests=rule)
    except (TypeError, ValueError, ArithmeticError, NotImplementedError):
        # (block_size_tokens=0 divides by a zero block size before any check;
        # buffer_size_gb=inf overflows int().)
        return None
    return layout.max_requests


def request_rows(kwargs: Dict[str, Any], tp: int) -> Optional[int]:
    """``max_requests`` for the engine's context: the context's default (None) when it fits
    ``max_tokens``, else ``max_tokens`` rounded down to the request rounder (and to ``tp``)."""
    if kwargs.get("max_requests") is not None:
        return kwargs["max_requests"]
    max_tokens = kwargs.get("max_tokens") or DynamicInferenceContext.DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
            or max_tokens < 1:
        return None  # the context names max_tokens
    derived = derived_max_requests(kwargs, tp)
    if derived is None or derived <= max_tokens:
        return None
    rounder = math.lcm(DynamicInferenceContext.REQUEST_ROUNDER, tp)
    # Fewer tokens than the rounder: a multiple of tp (the context asks no more); none at all
    # leaves the derived count, which the context refuses naming max_tokens and max_requests.
    rows = max_tokens - max_tokens % rounder or max_tokens - max_tokens % tp
    return rows or None


def build_from_transformers(engine_class: type, hf_model: Any, *, rope: str,
                            attention_backend: str, enable_chunked_prefill: bool, seed: int,
                            record_logits: bool, step_callback: Any,
                            history_window: Optional[int], cuda_graphs: bool,
                            async_scheduling: bool, enable_prefix_caching: bool,
                            prefix_caching_eviction_policy: str, integration: str,
                            num_speculative_tokens: int = 0, drafter: Any = None,
                            **context_kwargs: Any) -> Any:
    """``Engine.from_transformers`` (see there)."""
    from dynctx.models import TensorParallel

    if not hasattr(hf_model, "config") or not callable(getattr(hf_model, "parameters", None)):
        raise TypeError(f"hf_model={type(hf_model).__name__} must be a transformers causal LM "
                        "(with .config and .parameters())")
    check_choice("attention_backend", attention_backend, ATTENTION_BACKENDS)
    drafter = speculative_options(engine_class, hf_model, num_speculative_tokens, drafter,
                                  context_kwargs)
    graphs = bool(cuda_graphs and context_kwargs.get("num_cuda_graphs"))
    build, attention_backend = transformers_adapter(hf_model, attention_backend, graphs,
                                                    integration)
    config = hf_model.config
    param = next(hf_model.parameters())
    kwargs = dict(context_kwargs, num_speculative_tokens=num_speculative_tokens,
                  enable_prefix_caching=enable_prefix_caching,
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
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"params_dtype={dtype!r} must be a floating torch.dtype")
    if cuda_graphs and kwargs.get("num_cuda_graphs"):
        block_size = kwargs.get("block_size_tokens") or _context_default("block_size_tokens")
        attention_backend = graph_attention_backend(attention_backend, device, block_size,
                                                    dtype)
    model = build(hf_model, device=device, dtype=dtype, rope=rope,
                  attention_backend=attention_backend,
                  **({"tensor_parallel": tp} if tp.size > 1 else {}))
    kwargs.setdefault("num_layers", model.num_layers)
    kwargs.setdefault("kv_channels", model.head_dim)
    kwargs.setdefault("num_attention_heads",
                      getattr(model, "context_kv_heads", model.num_kv_heads))
    check_windows(kwargs.get("kv_layer_windows"),
                  getattr(model, "context_kwargs", {}).get("kv_layer_windows"))
    for key, value in getattr(model, "context_kwargs", {}).items():  # e.g. the MLA cache
        kwargs.setdefault(key, value)
    if getattr(model, "mamba_inference_state_config", None) is not None:
        kwargs.setdefault("mamba_inference_state_config", model.mamba_inference_state_config)
    kwargs.setdefault("max_sequence_length", config.max_position_embeddings)
    kwargs.setdefault("buffer_size_gb", 1.0)
    kwargs.update(params_dtype=dtype, device=device)
    kwargs["max_requests"] = request_rows(kwargs, tp.size)
    context = DynamicInferenceContext(**kwargs)
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return engine_class(model, context, enable_chunked_prefill=enable_chunked_prefill, seed=seed,
                        default_termination_id=eos, record_logits=record_logits,
                        step_callback=step_callback, history_window=history_window,
                        cuda_graphs=cuda_graphs, async_scheduling=async_scheduling,
                        drafter=drafter)


def check_windows(given: Any, own: Optional[list]) -> None:
    """``kv_layer_windows`` given to ``from_transformers`` must be the model's own (``own``;
    None: every layer attends to all keys): the context frees the blocks a window no longer
    reads, which a layer without that window still reads."""
    if not isinstance(given, (list, tuple)):
        return  # None (the model's), or the context's own check names it
    if list(given) != (own or [None] * len(given)):
        raise ValueError(f"kv_layer_windows={list(given)!r} differs from the model's sliding "
                         f"windows ({own if own else 'none: every layer reads all its keys'}): "
                         "the context would free blocks the model's attention still reads; "
                         "leave kv_layer_windows out (the engine takes the model's)")


# The target's context options a draft model's context shares (engine/draft_model.py; it
# takes its sizes from the target's context).
DRAFT_SHARED_OPTIONS = ("kernel_backend", "device")


def speculative_options(engine_class: type, hf_model: Any, k: Any, drafter: Any,
                        context_kwargs: Dict[str, Any]) -> Any:
    """The drafter for ``num_speculative_tokens=k`` (None without speculation), every option
    checked before anything is built: ``k`` an int, 0 or in ``[1, block_size_tokens)``; a
    drafter only with ``k >= 1`` (``"ngram"`` by default), of the target's vocabulary. A draft
    model's engine takes the target's ``DRAFT_SHARED_OPTIONS``."""
    from .draft_model import draft_model_drafter
    from .drafters import is_transformers_model, make_drafter

    block_size = context_kwargs.get("block_size_tokens") or _context_default("block_size_tokens")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"num_speculative_tokens={k!r} must be an int")
    k = int(k)  # numpy's integers too, as the context takes them
    if k == 0:
        if drafter is not None:
            raise ValueError(f"drafter={drafter!r} needs num_speculative_tokens >= 1 (got 0)")
        return None
    if not 1 <= k < block_size:
        raise ValueError(f"num_speculative_tokens={k} must be >= 1 and < block_size_tokens "
                         f"({block_size}): a step's 1 + k tokens must fit in two blocks")
    vocab = getattr(hf_model.config, "vocab_size", None)
    if is_transformers_model(drafter):
        shared = {name: context_kwargs[name] for name in DRAFT_SHARED_OPTIONS
                  if context_kwargs.get(name) is not None}
        return draft_model_drafter(drafter, vocab, engine_class, **shared)
    return make_drafter("ngram" if drafter is None else drafter, vocab)
